"""No step copies the KV pool: MLX's peak memory during mixed steps stays far below
the pool's size, with a pool of 1 GiB (MLX updates arrays functionally and reuses a
buffer only when no pending work still reads it)."""

import asyncio
import random

import mlx.core as mx
import pytest
from conftest import collect, reference_greedy
from tiny_models import make_tiny_model

from mlx_worker import Engine, EngineConfig, Request, SamplingParams

POOL_TOKENS = 1 << 21  # tiny llama: 512 bytes a token -> a 1 GiB pool
STEP_BUDGET = 32 << 20  # far above a tiny model's activations, far below one layer's pool array


@pytest.fixture(scope="module")
def engine():
    # Steps in tokens: the mixes these tests need run whatever they cost (a time budget would cut them).
    eng = Engine(EngineConfig(max_total_tokens=POOL_TOKENS, step_budget="tokens"), model=make_tiny_model("llama"))
    assert eng.pool.nbytes >= 1 << 30
    yield eng
    eng.shutdown()


def prompt(n, seed):
    rng = random.Random(seed)
    return [rng.randrange(100, 40000) for _ in range(n)]


def req(rid, p, n):
    return Request(rid=rid, prompt_ids=p, params=SamplingParams(max_tokens=n, ignore_eos=True, temperature=0.0))


def record_plans(eng):
    """(decode rows, sorted prefill chunk lengths) of every step the worker launches."""
    plans, launch = [], eng.worker.launch

    def recording(plan):
        plans.append((len(plan.decode), sorted(c.length for c in plan.prefills)))
        return launch(plan)

    eng.worker.launch = recording
    return plans


def peak_growth(eng, scenario):
    """MLX's peak memory above what was allocated before `scenario` ran."""
    mx.synchronize()
    mx.reset_peak_memory()
    base = mx.get_active_memory()
    result = asyncio.run(scenario())
    return mx.get_peak_memory() - base, result


def test_prompts_joining_a_decode_batch_copy_nothing(engine):
    plans = record_plans(engine)
    joining = [prompt(200, 1), prompt(137, 2)]

    async def scenario():
        first = engine.generate(req("decoding", prompt(30, 0), 40))
        toks = (await first.__anext__()).token_ids  # decoding now; the two prompts join it
        rest = asyncio.gather(*[collect(engine, req(f"join{i}", p, 8)) for i, p in enumerate(joining)])
        async for out in first:
            toks += out.token_ids
        return toks, await rest

    growth, (toks, joined) = peak_growth(engine, scenario)
    assert (1, [137, 200]) in plans  # a step with a decode row and two prefill chunks of different lengths ran
    assert growth < STEP_BUDGET, f"peak memory grew by {growth / 2**20:.0f} MiB (pool {engine.pool.nbytes / 2**20:.0f} MiB)"
    model = engine.model
    assert toks == reference_greedy(model, prompt(30, 0), 40)
    for p, (t, _) in zip(joining, joined):
        assert t == reference_greedy(model, p, 8)


def test_ragged_decode_and_chunked_prefill_copy_nothing(engine):
    plans = record_plans(engine)
    ps = [prompt(n, 10 + n) for n in (10, 50, 90, 33)]

    async def scenario():
        return await asyncio.gather(*[collect(engine, req(f"r{i}", p, 20)) for i, p in enumerate(ps)])

    growth, outs = peak_growth(engine, scenario)
    assert sum(1 for d, _ in plans if d == 4) >= 10  # ragged decode steps ran, staged after the second
    assert growth < STEP_BUDGET, f"peak memory grew by {growth / 2**20:.0f} MiB"
    for p, (t, _) in zip(ps, outs):
        assert t == reference_greedy(engine.model, p, 20)

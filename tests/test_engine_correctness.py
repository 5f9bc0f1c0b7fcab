"""Greedy tokens from the engine equal mlx-lm's own generation, token for token."""

import asyncio
import random

import pytest
from conftest import collect, reference_greedy, run_requests
from tiny_models import make_tiny_model

from mlx_worker import Engine, EngineConfig, Request, SamplingParams

ARCHS = ["llama", "qwen3", "gemma3_text"]  # gemma3_text has sliding-window layers


@pytest.fixture(scope="module", params=ARCHS)
def model(request):
    return make_tiny_model(request.param)


def prompts(n, lo, hi, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(100, 40000) for _ in range(rng.randrange(lo, hi))] for _ in range(n)]


DECODE_KV = {}


@pytest.fixture(autouse=True, params=[8.0, 0.0], ids=["staged-decode-kv", "gathered-decode-kv"])
def decode_kv(request):
    """Every test twice: decode reading the staged dense KV (decode_kv.py), and gathering
    from the pool each step."""
    DECODE_KV["decode_staging_fraction"] = request.param
    return request.param


def engine(model, **kw):
    kw.setdefault("max_total_tokens", 4096)
    return Engine(EngineConfig(**{**DECODE_KV, **kw}), model=model)


def check(model, eng, ps, n):
    outs = run_requests(eng, ps, n)
    for p, (toks, last) in zip(ps, outs):
        assert toks == reference_greedy(model, p, n)
        assert last.finish_reason == "length" and last.num_output_tokens == n
    return outs


def test_single_request(model):
    eng = engine(model)
    check(model, eng, prompts(1, 20, 21), 24)
    eng.shutdown()


@pytest.mark.parametrize("overlap", [True, False])
def test_ragged_concurrent_batch(model, overlap, decode_kv):
    eng = engine(model, overlap=overlap)
    check(model, eng, prompts(8, 3, 70, seed=1), 20)
    assert eng.stats()["kv_pages_used"] == 0
    assert (eng.worker.kv.staging.current is not None) == (decode_kv > 0)  # the path under test ran
    eng.shutdown()


def test_chunked_prefill_with_one_token_final_chunk(model):
    eng = engine(model, max_batched_tokens=16)
    check(model, eng, [prompts(1, 33, 34, seed=2)[0]], 12)  # chunks 16 + 16 + 1
    eng.shutdown()


def test_prefix_hit(model):
    eng = engine(model)
    shared = prompts(1, 70, 71, seed=3)[0]
    check(model, eng, [shared + [7, 8, 9]], 8)
    (toks, last), = check(model, eng, [shared + [11, 12]], 10)
    assert last.num_cached_tokens == 64  # 4 whole pages of the 70 shared tokens
    assert eng.stats()["prefix_hit_tokens"] == 64
    eng.shutdown()


def test_prefix_hit_of_a_whole_prompt_recomputes_the_last_token(model):
    eng = engine(model)
    p = prompts(1, 32, 33, seed=4)[0]  # exactly two pages
    check(model, eng, [p], 5)
    (_, last), = check(model, eng, [p], 5)
    assert last.num_cached_tokens == 16  # the last page is recomputed for its logits
    eng.shutdown()


def test_preemption_and_resume(model):
    # 8 pages of 16 tokens; three requests need 3 x 4 pages: someone must be preempted.
    eng = engine(model, max_total_tokens=128, page_size=16)
    ps = prompts(3, 20, 24, seed=5)
    check(model, eng, ps, 40)
    st = eng.stats()
    assert st["preemptions"] > 0
    assert st["kv_pages_used"] == 0
    eng.shutdown()


def test_equal_length_chunks_at_different_offsets_share_a_forward(model):
    eng = engine(model)
    shared = prompts(1, 32, 33, seed=6)[0]
    check(model, eng, [shared + [5, 6, 7]], 2)  # caches the 32-token prefix
    tails = prompts(4, 20, 21, seed=7)
    # Two rows resume after the cached 32 tokens, two start at 0: all chunks are 20 long.
    check(model, eng, [shared + tails[0], shared + tails[1], tails[2], tails[3]], 10)
    assert eng.stats()["prefix_hit_tokens"] == 64
    eng.shutdown()


def test_rows_join_and_leave_a_running_decode_batch(model, decode_kv):
    """Churn: requests of different lengths arrive while others decode and end at
    different steps (staged: joins gather one row from the pool, leaves move a row)."""
    eng = engine(model, max_total_tokens=8192)
    ps = prompts(10, 3, 90, seed=8)
    lengths = [5 + 7 * i % 23 for i in range(len(ps))]

    async def main():
        async def one(i):
            await asyncio.sleep(0.02 * i)
            return await collect(eng, Request(rid=f"c{i}", prompt_ids=ps[i], params=SamplingParams(
                max_tokens=lengths[i], ignore_eos=True, temperature=0.0)))
        return await asyncio.gather(*[one(i) for i in range(len(ps))])

    outs = asyncio.run(main())
    for p, n, (toks, _) in zip(ps, lengths, outs):
        assert toks == reference_greedy(model, p, n)
    staging = eng.worker.kv.staging
    if decode_kv:
        assert staging.num_joined > len(ps) // 2 and staging.num_moved > 0 and staging.num_gathered == 0
    else:
        assert staging.num_staged == 0
    eng.shutdown()



def test_batch_is_restaged_smaller_rather_than_gathered_under_a_tight_cap(model, decode_kv):
    """A staging cap that holds ten rows only in arrays of their exact size: a long row
    decodes alone (arrays rounded up to 256 positions), then nine short ones join. The
    batch is restaged in smaller arrays instead of gathered, and tokens stay mlx-lm's."""
    if not decode_kv:
        pytest.skip("staging is off")
    eng = engine(model, max_total_tokens=8192)
    staging = eng.worker.kv.staging
    staging.max_bytes = staging.bytes_per_position * 10 * 200
    long, shorts = prompts(1, 150, 151, seed=9)[0], prompts(9, 12, 13, seed=10)

    async def main():
        def run(rid, p, n):
            return collect(eng, Request(rid=rid, prompt_ids=p, params=SamplingParams(
                max_tokens=n, ignore_eos=True, temperature=0.0)))
        gen = eng.generate(Request(rid="long", prompt_ids=long, params=SamplingParams(
            max_tokens=45, ignore_eos=True, temperature=0.0)))
        first = await gen.__anext__()  # the long row decodes alone, then the short ones join it
        rest = asyncio.gather(*[run(f"s{i}", p, 16) for i, p in enumerate(shorts)])
        toks = list(first.token_ids)
        async for out in gen:
            toks += out.token_ids
        return toks, [t for t, _ in await rest]

    long_toks, short_toks = asyncio.run(main())
    assert long_toks == reference_greedy(model, long, 45)
    for p, toks in zip(shorts, short_toks):
        assert toks == reference_greedy(model, p, 16)
    assert staging.num_gathered == 0 and staging.num_restaged > 0
    assert eng.stats()["decode_steps_restaged"] == staging.num_restaged
    eng.shutdown()

"""Models beyond plain attention: recurrent and hybrid layers (mlx-lm ArraysCache),
layers with several caches (CacheList), chunked attention, and models whose code cannot
take rows at different positions. Greedy tokens equal mlx-lm's own, token for token,
under batching, chunked prefill, prefix hits and preemption."""

import asyncio
import json
import random

import jsonschema
import pytest
from conftest import collect, default_tokenizer, reference_greedy, run_requests
from tiny_models import make_tiny_model

from mlx_worker import Engine, EngineConfig, Request, SamplingParams
from mlx_worker.sampling.grammar import GrammarSpec

RECURRENT = ["qwen3_5", "qwen3_5_moe", "qwen3_next", "nemotron_h", "lfm2", "granitemoehybrid", "falcon_h1",
             "mamba2", "kimi_linear", "jamba", "rwkv7"]
OTHER = ["deepseek_v32", "llama4", "gemma2", "gpt_bigcode", "afm7"]
# What the load-time probe finds (batch_probe.py); every other model takes ragged rows.
BATCHING = {"gemma2": "ragged_head_groups", "gpt_bigcode": "uniform_offsets", "afm7": "uniform_offsets",
            "llama4": "uniform_offsets"}


@pytest.fixture(scope="module", params=RECURRENT + OTHER)
def arch(request):
    return request.param


@pytest.fixture(scope="module")
def model(arch):
    return make_tiny_model(arch)


def prompts(n, lo, hi, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(100, 40000) for _ in range(rng.randrange(lo, hi))] for _ in range(n)]


def check(model, eng, ps, n):
    outs = run_requests(eng, ps, n)
    for p, (toks, last) in zip(ps, outs):
        assert toks == reference_greedy(model, p, n)
        assert last.finish_reason == "length"
    return outs


def test_ragged_concurrent_batch(arch, model):
    eng = Engine(EngineConfig(max_total_tokens=4096), model=model)
    st = eng.stats()
    assert st["batching"] == BATCHING.get(arch, "ragged")
    assert (st["recurrent_state_bytes_per_request"] > 0) == (arch in RECURRENT)
    check(model, eng, prompts(1, 20, 21), 12)  # alone
    check(model, eng, prompts(6, 3, 70, seed=1), 12)  # rows at different positions
    assert eng.stats()["kv_pages_used"] == 0
    eng.shutdown()


def test_chunked_prefill_with_one_token_final_chunk(model):
    eng = Engine(EngineConfig(max_total_tokens=4096, max_batched_tokens=16), model=model)
    check(model, eng, prompts(2, 33, 34, seed=2), 8)  # chunks 16 + 16 + 1
    eng.shutdown()


def test_prefix_hit_resumes_from_the_cache(arch, model):
    """The second prompt shares 4 pages (64 tokens) and computes one more token from
    there: for a recurrent model from the state snapshot taken at the first prompt's last
    full page (with little left to compute, a wrong state shows in the tokens)."""
    eng = Engine(EngineConfig(max_total_tokens=4096), model=model)
    shared = prompts(1, 64, 65, seed=3)[0]
    check(model, eng, [shared + [7]], 6)
    (_, last), = check(model, eng, [shared + [11]], 6)
    assert last.num_cached_tokens == 64
    st = eng.stats()
    if arch in RECURRENT:
        assert st["state_snapshots"] > 0 and st["state_snapshot_bytes"] > 0
        assert len(st["cached_page_hashes"]) >= 1  # the resumable pages, for the router
    eng.shutdown()


def test_a_shared_prefix_resumes_where_prompts_branch(arch, model):
    """Two prompts share 40 tokens, then differ. The second finds 2 cached pages of the
    first; a recurrent model has no snapshot there yet, so it computes them and leaves
    one at the branch point: a third prompt with the same prefix resumes there."""
    eng = Engine(EngineConfig(max_total_tokens=4096), model=model)
    shared = prompts(1, 40, 41, seed=11)[0]
    tails = prompts(3, 10, 11, seed=12)
    outs = [check(model, eng, [shared + t], 4)[0][1] for t in tails]
    assert [o.num_cached_tokens for o in outs] == [0, 0 if arch in RECURRENT else 32, 32]
    eng.shutdown()


def test_preemption_and_resume(model):
    eng = Engine(EngineConfig(max_total_tokens=128, page_size=16), model=model)
    check(model, eng, prompts(3, 20, 24, seed=5), 40)
    st = eng.stats()
    assert st["preemptions"] > 0 and st["kv_pages_used"] == 0
    eng.shutdown()


def test_abort_mid_decode_on_a_hybrid_model():
    """A request aborted while others decode beside it: its pages and state go, the others'
    tokens still equal mlx-lm's, and the next request runs."""
    model = make_tiny_model("qwen3_next")
    eng = Engine(EngineConfig(max_total_tokens=4096), model=model)
    ps = prompts(3, 10, 40, seed=13)

    async def main():
        async def aborted():
            req = Request(rid="gone", prompt_ids=ps[0], params=SamplingParams(max_tokens=200, ignore_eos=True))
            async for _ in eng.generate(req):
                break  # its first tokens are out: closing the stream aborts it
        kept = [collect(eng, Request(rid=f"k{i}", prompt_ids=p, params=SamplingParams(
            max_tokens=12, ignore_eos=True, temperature=0.0))) for i, p in enumerate(ps[1:])]
        return (await asyncio.gather(aborted(), *kept))[1:]

    for p, (toks, _) in zip(ps[1:], asyncio.run(main())):
        assert toks == reference_greedy(model, p, 12)
    check(model, eng, [ps[0]], 6)
    assert eng.stats()["kv_pages_used"] == 0 and eng.stats()["running"] == 0
    eng.shutdown()


def test_samples_seeds_and_structured_output_on_a_hybrid_model():
    """n > 1, seeded sampling and a JSON schema on qwen3_next: the n greedy samples equal
    mlx-lm's, a seed gives the same tokens alone and beside other requests, and the
    constrained output validates."""
    model = make_tiny_model("qwen3_next")
    tok = default_tokenizer()
    eng = Engine(EngineConfig(max_total_tokens=4096), model=model, tokenizer=tok)
    p = prompts(1, 40, 41, seed=9)[0]
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
              "additionalProperties": False}

    def req(rid, prompt=p, **kw):
        return Request(rid=rid, prompt_ids=prompt, params=SamplingParams(**{"max_tokens": 10, "ignore_eos": True, **kw}))

    async def samples(request):
        by_index = {}
        async for o in eng.generate(request):
            by_index.setdefault(o.index, []).extend(o.token_ids)
        return by_index

    async def main():
        greedy = await samples(req("n", n=2, temperature=0.0))
        alone = await collect(eng, req("s1", temperature=1.0, seed=5))
        others = [req(f"o{i}", prompt=q, temperature=1.0) for i, q in enumerate(prompts(3, 5, 60, seed=10))]
        beside = await asyncio.gather(collect(eng, req("s2", temperature=1.0, seed=5)), *[collect(eng, r) for r in others])
        structured = await collect(eng, req("j", max_tokens=60, ignore_eos=False, temperature=1.0, seed=3,
                                            structured=GrammarSpec(json_schema=schema)))
        return greedy, alone, beside[0], structured

    greedy, alone, beside, (toks, last) = asyncio.run(main())
    ref = reference_greedy(model, p, 10)
    assert greedy == {0: ref, 1: ref}
    assert alone[0] == beside[0]
    assert last.finish_reason == "stop"
    jsonschema.validate(json.loads(tok.decode(toks, skip_special_tokens=True)), schema)
    eng.shutdown()

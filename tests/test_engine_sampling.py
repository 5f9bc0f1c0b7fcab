"""Sampling through the engine: reproducible seeds, n, min_tokens, logprobs, stop strings."""

import asyncio
import random
import time

import mlx.core as mx
import numpy as np
import pytest
from conftest import collect, default_tokenizer, reference_greedy
from tiny_models import make_tiny_model

from mlx_worker import Engine, EngineConfig, Request, SamplingParams


@pytest.fixture(scope="module")
def model():
    return make_tiny_model("llama")


@pytest.fixture(scope="module")
def tokenizer():
    return default_tokenizer()


def prompt(n, seed):
    rng = random.Random(seed)
    return [rng.randrange(100, 40000) for _ in range(n)]


def run(engine, reqs):
    async def main():
        return await asyncio.gather(*[collect(engine, r) for r in reqs])

    return asyncio.run(main())


def sampled(rid, p, **kw):
    kw.setdefault("max_tokens", 16)
    return Request(rid=rid, prompt_ids=p, params=SamplingParams(temperature=1.0, ignore_eos=True, **kw))


def test_seeded_request_is_reproducible_whatever_the_batch_chunking_or_preemption(model):
    p = prompt(40, 1)
    alone = Engine(EngineConfig(max_total_tokens=2048), model=model)
    (ref, _), = run(alone, [sampled("a", p, seed=123, max_tokens=30)])
    (ref2, _), = run(alone, [sampled("b", p, seed=123, max_tokens=30)])  # prefix hit now
    assert ref == ref2
    alone.shutdown()

    # Batched with others, prompt chunked by 16, and a pool small enough to preempt.
    eng = Engine(EngineConfig(max_total_tokens=160, max_batched_tokens=16), model=model)
    others = [sampled(f"o{i}", prompt(30, 10 + i), max_tokens=30) for i in range(3)]
    outs = run(eng, others + [sampled("s", p, seed=123, max_tokens=30)])
    assert outs[-1][0] == ref
    assert eng.stats()["preemptions"] > 0
    eng.shutdown()


def test_unseeded_requests_differ_between_runs(model):
    eng = Engine(EngineConfig(max_total_tokens=2048), model=model)
    p = prompt(20, 2)
    runs = {tuple(run(eng, [sampled(f"u{i}", p)])[0][0]) for i in range(3)}
    assert len(runs) == 3
    eng.shutdown()


def test_n_samples_share_the_prompt_pages(model):
    eng = Engine(EngineConfig(max_total_tokens=2048), model=model)
    p = prompt(70, 3)
    req = sampled("n", p, n=3, seed=5, max_tokens=8)

    async def main():
        outs = {}
        async for out in eng.generate(req):
            assert out.rid == "n"
            outs.setdefault(out.index, []).extend(out.token_ids)
        return outs

    outs = asyncio.run(main())
    assert sorted(outs) == [0, 1, 2] and all(len(v) == 8 for v in outs.values())
    assert len({tuple(v) for v in outs.values()}) == 3
    assert eng.stats()["prefix_hit_tokens"] == 2 * 64  # samples 1 and 2 reuse 4 pages
    eng.shutdown()


def test_min_tokens_hides_stop_tokens(model):
    p = prompt(20, 4)
    ref = reference_greedy(model, p, 6)
    eng = Engine(EngineConfig(max_total_tokens=2048), model=model)
    greedy = dict(temperature=0.0, max_tokens=6)
    (toks, last), = run(eng, [Request(rid="m0", prompt_ids=p, params=SamplingParams(stop_token_ids=[ref[0]], **greedy))])
    assert toks == ref[:1] and last.finish_reason == "stop" and last.stop_reason == ref[0]
    (toks, last), = run(eng, [Request(rid="m1", prompt_ids=p, params=SamplingParams(stop_token_ids=[ref[0]], min_tokens=3, **greedy))])
    assert len(toks) >= 3 and toks[0] != ref[0]
    eng.shutdown()


def test_logprobs_match_mlx_lm_logits(model):
    p = prompt(25, 5)
    eng = Engine(EngineConfig(max_total_tokens=2048), model=model)
    params = SamplingParams(temperature=0.0, max_tokens=5, logprobs=True, top_logprobs=3, ignore_eos=True)

    async def main():
        return [o async for o in eng.generate(Request(rid="lp", prompt_ids=p, params=params))]

    outs = asyncio.run(main())
    toks = [t for o in outs for t in o.token_ids]
    logits = model(mx.array([p + toks[:-1]]))[0, len(p) - 1 :].astype(mx.float32)
    ref = np.array(logits - mx.logsumexp(logits, axis=-1, keepdims=True))
    for i, o in enumerate(outs):
        assert o.logprobs[0] == pytest.approx(ref[i, toks[i]], abs=1e-4)
        best = np.argsort(-ref[i])[:3]
        assert [t for t, _ in o.top_logprobs[0]] == best.tolist()
        assert [v for _, v in o.top_logprobs[0]] == pytest.approx(ref[i, best].tolist(), abs=1e-4)
    eng.shutdown()


def test_stop_string_ends_output_without_leaking(model, tokenizer):
    p = prompt(20, 6)
    ref = reference_greedy(model, p, 30)
    text = tokenizer.decode(ref)
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    expected = text[: text.index(stop)]
    eng = Engine(EngineConfig(max_total_tokens=2048), model=model, tokenizer=tokenizer)
    params = SamplingParams(temperature=0.0, max_tokens=30, stop=[stop], ignore_eos=True)

    async def main():
        return [o async for o in eng.generate(Request(rid="st", prompt_ids=p, params=params))]

    outs = asyncio.run(main())
    assert "".join(o.text for o in outs) == expected
    assert outs[-1].finish_reason == "stop" and outs[-1].stop_reason == stop
    for _ in range(100):  # the abort that freed it is applied before the next step
        if eng.stats()["running"] == 0:
            break
        time.sleep(0.01)
    assert eng.stats()["running"] == 0 and eng.stats()["kv_pages_used"] == 0
    eng.shutdown()


def test_unknown_logit_bias_id_is_an_error(model):
    eng = Engine(EngineConfig(max_total_tokens=256), model=model)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        run(eng, [sampled("bad", prompt(5, 7), logit_bias={10**7: 1.0})])
    (toks, _), = run(eng, [sampled("ok", prompt(5, 7), max_tokens=3)])
    assert len(toks) == 3
    eng.shutdown()

"""Quantized KV pages (`engine.kv_bits`): the engine's greedy tokens equal mlx-lm's own
generation with its `QuantizedKVCache` at the same bits and group size (from the first
token: `prompt_cache` of quantized caches), alone, batched, in prefill chunks and on
prefix hits, for a plain and a hybrid model, decode reading the staged (quantized) copy of
the batch's KV or gathering from the pool; the pool's bytes a token shrink as the
bits say; head dims that no group size divides are refused at startup."""

import random

import mlx.core as mx
import pytest
from conftest import run_requests
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import KVCache, QuantizedKVCache, make_prompt_cache
from tiny_models import make_tiny_model

from mlx_worker import Engine, EngineConfig

N = 12
GROUP = 32


def quantized_reference(model, prompt, bits):
    """mlx-lm's greedy tokens with its quantized cache on every attention layer."""
    cache = [QuantizedKVCache(group_size=GROUP, bits=bits) if type(c) is KVCache else c
             for c in make_prompt_cache(model)]
    return [int(t) for t, _ in generate_step(mx.array(prompt), model, max_tokens=N, prompt_cache=cache,
                                             sampler=lambda logits: mx.argmax(logits, axis=-1))]


def prompts(seed, lengths):
    rng = random.Random(seed)
    return [[rng.randrange(1000, 40000) for _ in range(n)] for n in lengths]


@pytest.fixture(scope="module", params=["qwen3", "qwen3_next"])
def model(request):
    return make_tiny_model(request.param, head_dim=32)  # group sizes start at 32


@pytest.mark.parametrize("staging", [0.5, 0.0], ids=["staged-decode-kv", "gathered-decode-kv"])
@pytest.mark.parametrize("bits", [8, 4])
def test_tokens_equal_mlx_lms_quantized_cache_batched_chunked_and_on_prefix_hits(model, bits, staging):
    eng = Engine(EngineConfig(max_total_tokens=4096, kv_bits=bits, kv_group_size=GROUP, max_batched_tokens=48,
                              decode_staging_fraction=staging), model=model)
    try:
        first = prompts(bits, (5, 40, 77, 130))
        outs = run_requests(eng, first, N)
        for p, (toks, _) in zip(first, outs):
            assert toks == quantized_reference(model, p, bits)
        # The same prompts continued: their pages (written quantized) are prefix hits.
        second = [p + q for p, q in zip(first, prompts(bits + 1, (60, 20, 3, 40)))]
        outs = run_requests(eng, second, N)
        for p, (toks, last) in zip(second, outs):
            assert toks == quantized_reference(model, p, bits)
        assert sum(last.num_cached_tokens for _, last in outs) >= 3 * 32
        assert eng.stats()["kv_bits"] == bits and eng.stats()["kv_pages_used"] == 0
        assert (eng.stats()["decode_steps_staged"] > 0) == (staging > 0)  # the decode path under test ran
    finally:
        eng.shutdown()


def test_a_token_takes_the_bytes_its_bits_say():
    model = make_tiny_model("qwen3", head_dim=32)  # 2 layers, 2 KV heads, fp32
    sizes = {}
    for bits in (None, 8, 4):
        eng = Engine(EngineConfig(max_total_tokens=1024, kv_bits=bits, kv_group_size=GROUP), model=model)
        try:
            sizes[bits] = eng.kv_bytes_per_token
            assert eng.pool.nbytes == eng.pages.num_pages * eng.pages.page_size * eng.kv_bytes_per_token
        finally:
            eng.shutdown()
    # Per head and token: K and V of 32 values, each group of 32 with an fp32 scale and bias.
    assert sizes == {None: 2 * 2 * 2 * 32 * 4, 8: 2 * 2 * 2 * (32 + 8), 4: 2 * 2 * 2 * (16 + 8)}


def test_head_dims_no_group_divides_are_refused_at_startup():
    with pytest.raises(ValueError, match="multiples of kv_group_size 64"):
        Engine(EngineConfig(max_total_tokens=1024, kv_bits=8), model=make_tiny_model("qwen3", head_dim=32))

"""Prompt logprobs (lm-eval's loglikelihood shape): each prompt token's logprob under the
model, computed only for requests that ask, equal to mlx-lm's full forward."""

import asyncio

import mlx.core as mx
from conftest import collect
from tiny_models import make_tiny_model

from mlx_worker import Engine, EngineConfig, Request, SamplingParams


def reference(model, prompt, k):
    logits = model(mx.array([prompt]))[0].astype(mx.float32)
    lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    chosen = [lp[i, prompt[i + 1]].item() for i in range(len(prompt) - 1)]
    top = [sorted(enumerate(row), key=lambda x: -x[1])[:k] for row in lp[:-1].tolist()]
    return chosen, top


def test_prompt_logprobs_equal_mlx_lm_under_chunking_and_cache_hits():
    model = make_tiny_model("llama")
    eng = Engine(EngineConfig(max_total_tokens=4096, max_batched_tokens=16), model=model)  # 40 tokens: 3 chunks
    prompt = [(i * 7919) % 40000 + 100 for i in range(40)]
    want, want_top = reference(model, prompt, 2)

    async def main():
        plain = await collect(eng, Request(rid="plain", prompt_ids=prompt, params=SamplingParams(max_tokens=3)))
        scored = await collect(eng, Request(rid="scored", prompt_ids=prompt, params=SamplingParams(
            max_tokens=0, prompt_logprobs=2)))
        both = [o async for o in eng.generate(Request(rid="both", prompt_ids=prompt, params=SamplingParams(
            max_tokens=4, temperature=0.0, ignore_eos=True, prompt_logprobs=0)))]
        return plain, scored, both

    (_, plain), (toks, scored), outs = asyncio.run(main())
    btoks, both = [t for o in outs for t in o.token_ids], outs[0]  # the first output carries them
    assert plain.prompt_logprobs is None  # not asked: not computed
    assert toks == [] and scored.finish_reason == "length" and scored.num_output_tokens == 0
    assert scored.num_cached_tokens == 0  # scored from scratch although the prompt is cached
    assert scored.prompt_logprobs[0] is None and len(scored.prompt_logprobs) == len(prompt)
    assert mx.allclose(mx.array(scored.prompt_logprobs[1:]), mx.array(want), atol=1e-4).item()
    assert [[t for t, _ in row] for row in scored.prompt_top_logprobs[1:]] == [[t for t, _ in row] for row in want_top]
    assert len(btoks) == 4 and both.prompt_top_logprobs is None
    assert mx.allclose(mx.array(both.prompt_logprobs[1:]), mx.array(want), atol=1e-4).item()
    eng.shutdown()

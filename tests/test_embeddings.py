"""Embeddings from the serving engine: a prefill-only request whose output is the
prompt's pooled, normalized final hidden state, equal to mlx-lm's model body."""

import asyncio

import mlx.core as mx
import pytest
from conftest import collect
from tiny_models import make_tiny_model

from mlx_worker import Engine, EngineConfig, Request, SamplingParams


def reference(model, prompt, how):
    h = model.model(mx.array([prompt]))[0].astype(mx.float32)
    v = h.mean(axis=0) if how == "mean" else h[-1]
    return v / mx.linalg.norm(v)


@pytest.mark.parametrize("how", ["last", "mean"])
def test_embedding_equals_the_pooled_body_under_chunking_and_batching(how):
    model = make_tiny_model("qwen3")
    eng = Engine(EngineConfig(max_total_tokens=4096, max_batched_tokens=16), model=model)
    prompts = [[(i * 7 + j * 131) % 40000 + 100 for i in range(n)] for j, n in enumerate((5, 37, 37))]

    async def main():
        gen = collect(eng, Request(rid="gen", prompt_ids=prompts[1], params=SamplingParams(max_tokens=8)))
        embeds = [collect(eng, Request(rid=f"e{i}", prompt_ids=p, params=SamplingParams(max_tokens=0, embedding=how)))
                  for i, p in enumerate(prompts)]
        return await asyncio.gather(gen, *embeds)

    (_, gen), *outs = asyncio.run(main())
    assert gen.embedding is None
    for p, (toks, out) in zip(prompts, outs):
        assert toks == [] and out.finish_reason == "length"
        assert mx.allclose(mx.array(out.embedding), reference(model, p, how), atol=1e-4).item()
    eng.shutdown()

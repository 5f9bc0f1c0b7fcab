import asyncio
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import mlx_worker  # noqa: F401,E402  (loads OpenBLAS before mlx on Linux)
import mlx.core as mx  # noqa: E402
from mlx_lm.generate import generate_step  # noqa: E402

from mlx_worker import Request, SamplingParams  # noqa: E402


def reference_greedy(model, prompt, n):
    """mlx-lm's own greedy generation: the ground truth for the engine."""
    sampler = lambda logits: mx.argmax(logits, axis=-1)  # noqa: E731
    return [int(t) for t, _ in generate_step(mx.array(prompt), model, max_tokens=n, sampler=sampler)]


async def collect(engine, request):
    """All token ids of one request, and its last output."""
    toks, last = [], None
    async for out in engine.generate(request):
        toks += out.token_ids
        last = out
    return toks, last


def run_requests(engine, prompts, max_tokens, ignore_eos=True):
    """Run prompts concurrently; [(tokens, last_output)] in prompt order."""

    async def main():
        reqs = [
            Request(rid=f"r{i}", prompt_ids=p, params=SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos, temperature=0.0))
            for i, p in enumerate(prompts)
        ]
        return await asyncio.gather(*[collect(engine, r) for r in reqs])

    return asyncio.run(main())


_TOKENIZER = []


def default_tokenizer():
    """The default model's real tokenizer (mlx-lm wrapper), loaded once."""
    if not _TOKENIZER:
        from mlx_lm.utils import load_tokenizer

        from mlx_worker.models.gguf import default_model_path

        _TOKENIZER.append(load_tokenizer(default_model_path()))
    return _TOKENIZER[0]


def pytest_collection_modifyitems(items):
    """The modules that share one local Ray cluster (serve_fixtures.serving) run one after
    another, last: the cluster starts once for them, and never idles beside the engine tests.
    Those among them with a cluster of their own (`OWN_CLUSTER`) come after the rest, so
    that none stops the shared one while later modules still need it."""
    items.sort(key=lambda item: (hasattr(item.module, "serving"), getattr(item.module, "OWN_CLUSTER", False)))

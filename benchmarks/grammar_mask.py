"""Structured-output cost: the grammar mask per step vs the decode step it rides on.

    python benchmarks/grammar_mask.py [--requests 4] [--max-tokens 48]

Same engine, same model, same run: a batch of JSON-schema-constrained requests and a
batch of free requests; prints the time spent computing masks per step and both decode
rates.
"""

import argparse
import asyncio
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx_worker  # noqa: E402,F401  (OpenBLAS before mlx on Linux)
import numpy as np  # noqa: E402
from common import pct  # noqa: E402  (benchmarks/common.py)

from mlx_worker import Engine, EngineConfig, Request, SamplingParams  # noqa: E402
from mlx_worker.sampling import grammar  # noqa: E402
from mlx_worker.sampling.grammar import GrammarSpec  # noqa: E402

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 24},
          "age": {"type": "integer"}, "tags": {"type": "array", "items": {"type": "string"}}},
          "required": ["name", "age", "tags"]}

mask_times = []
_allowed = grammar.Matcher.allowed


def timed_allowed(self, *a, **k):
    t = time.perf_counter()
    out = _allowed(self, *a, **k)
    mask_times.append(time.perf_counter() - t)
    return out


grammar.Matcher.allowed = timed_allowed


async def run(engine, n, max_tokens, structured):
    async def one(i):
        ids = engine.tokenizer.apply_chat_template(
            [{"role": "user", "content": f"Describe person {i} as JSON with name, age and tags."}], add_generation_prompt=True)
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=not structured,
                                structured=GrammarSpec(json_schema=SCHEMA) if structured else None)
        toks, first, last = 0, None, None
        async for out in engine.generate(Request(rid=f"{structured}{i}", prompt_ids=ids, params=params)):
            toks += len(out.token_ids)
            first, last = first or time.perf_counter(), time.perf_counter()
        return toks, first, last

    res = await asyncio.gather(*[one(i) for i in range(n)])
    toks = sum(r[0] for r in res) - n
    return toks / (max(r[2] for r in res) - max(r[1] for r in res))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=48)
    args = ap.parse_args()
    engine = Engine(EngineConfig(max_total_tokens=8192))
    asyncio.run(run(engine, 1, 4, True))  # warm-up, grammar compile cache
    free = asyncio.run(run(engine, args.requests, args.max_tokens, False))
    mask_times.clear()
    constrained = asyncio.run(run(engine, args.requests, args.max_tokens, True))
    engine.shutdown()
    ms = np.array(mask_times) * 1e6
    steps = len(ms) / args.requests
    print(f"\n## Grammar mask cost (JSON schema, {args.requests} requests, vocab {engine.vocab_size})")
    print(f"mask per request-step: mean {ms.mean():.0f} us, p50 {pct(ms, 0.5):.0f} us, p99 {pct(ms, 0.99):.0f} us ({len(ms)} masks, ~{steps:.0f} steps)")
    step_ms = args.requests / free * 1e3
    print(f"decode: free {free:.1f} tok/s, constrained {constrained:.1f} tok/s ({constrained / free:.2f}x); "
          f"masks take {ms.mean() * args.requests / 1e3 / step_ms * 100:.2f}% of a {step_ms:.0f} ms step")


if __name__ == "__main__":
    main()

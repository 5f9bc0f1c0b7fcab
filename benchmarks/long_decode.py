"""Long-context decode, interleaved: the engine's full-batch decode step against mlx-lm's
BatchGenerator's, in alternating rounds in one process, so that the box's drift (up to
±15% within minutes on a shared 2-core CPU) falls on both systems alike.

    python benchmarks/long_decode.py [--lens 1536 8192] [--rows 4] [--rounds 6] [--tokens 24]

Per length, `rows` prompts share a prefix of `len - 64` tokens and end in 64 tokens of
their own (a prefix-cache hit for both: the engine's radix cache, and BatchGenerator
given a copy of the prefix's KV cache as mlx_lm.server's prompt cache gives it). Both
prefill that once, then decode the same rows at the same positions:

- BatchGenerator (mlx_lm.server's settings) keeps its rows; a round is `tokens` calls of
  `next()`, timed call to call.
- The engine (deployed default pool) gets, each round, one request per row whose prompt
  is that row's prompt plus everything it generated so far: the radix cache holds all
  but the last partial page, so the round starts with a prefill of a few tokens per row,
  then times the gaps between tokens while all rows decode (`full_batch_itl`).

Rounds alternate which system goes first. Printed per round: both median steps and
their ratio; at the end the median ratio over rounds (BatchGenerator step / engine
step: above 1 the engine is faster) and whether the greedy tokens agree.
"""

import argparse
import asyncio
import copy
import statistics
import time
from pathlib import Path
import sys

sys.path.insert(0, str(Path(__file__).resolve().parent))

from engine import SERVER_BG, build_engine, params  # noqa: E402  (benchmarks/engine.py)
import mlx.core as mx  # noqa: E402
from mlx_lm.generate import BatchGenerator  # noqa: E402
from mlx_lm.models.cache import make_prompt_cache  # noqa: E402

from mlx_worker import Request  # noqa: E402
from mlx_worker.models.loader import load_model  # noqa: E402
from traffic import Trace, full_batch_itl, prompts  # noqa: E402

TAIL = 64  # tokens of each row's own after the shared prefix


def prefill_cache(model, tokens, step=SERVER_BG["prefill_step_size"]):
    """mlx-lm's prompt cache for `tokens`, prefilled in mlx-lm's chunk size."""
    cache = make_prompt_cache(model)
    for i in range(0, len(tokens), step):
        model(mx.array([tokens[i:i + step]]), cache=cache)
        mx.eval([c.state for c in cache])
    return cache


class BatchGeneratorRows:
    """BatchGenerator with `rows` live requests, stepped a round at a time."""

    def __init__(self, model, prefix, tails, total_tokens):
        cache = prefill_cache(model, prefix)
        self.gen = BatchGenerator(model, stop_tokens=[], **SERVER_BG)
        uids = self.gen.insert(tails, [total_tokens] * len(tails), caches=[copy.deepcopy(cache) for _ in tails])
        self.row = {uid: i for i, uid in enumerate(uids)}
        self.tokens = [[] for _ in tails]
        while not all(self.tokens):  # the tails' prefill, up to every row's first token
            self._step()

    def _step(self):
        _, responses = self.gen.next()
        for r in responses:
            self.tokens[self.row[r.uid]].append(r.token)
        return len(responses)

    def round(self, n):
        """Median seconds per decode step over n steps of all rows."""
        times = [time.perf_counter()]
        for _ in range(n):
            if self._step() != len(self.tokens):
                raise RuntimeError("a BatchGenerator row ended early")
            times.append(time.perf_counter())
        mx.synchronize()  # its next step is already dispatched: finish it before the engine runs
        gaps = [b - a for a, b in zip(times, times[1:])]
        return statistics.median(gaps[1:])  # the first call returns a token computed before the pause

    def close(self):
        self.gen.close()


class EngineRows:
    """The engine's rows: each round, one request per row continuing where the last ended."""

    def __init__(self, engine, prefix, tails):
        self.engine, self.prompts = engine, [prefix + t for t in tails]
        self.tokens = [[] for _ in tails]
        self.rounds = 0
        asyncio.run(self._run([prefix + [tails[0][0]]], 1, "prefix"))  # the shared prefix, once
        asyncio.run(self._run(self.prompts, 1, "first"))  # the tails, up to each row's first token

    async def _run(self, ps, n, tag):
        t0 = time.perf_counter()
        trace = Trace(t0, [t0] * len(ps), [[] for _ in ps])

        async def one(i):
            req = Request(rid=f"{tag}-{i}", prompt_ids=ps[i], params=params(n))
            async for out in self.engine.generate(req, detokenize=False):
                trace.tokens[i].extend([time.perf_counter()] * len(out.token_ids))
                if tag != "prefix":
                    self.tokens[i].extend(out.token_ids)

        await asyncio.gather(*[one(i) for i in range(len(ps))])
        return trace

    def round(self, n):
        """Median seconds per full-batch decode step over a round of n tokens per row."""
        self.rounds += 1
        ps = [p + t for p, t in zip(self.prompts, self.tokens)]
        return statistics.median(full_batch_itl(asyncio.run(self._run(ps, n, f"r{self.rounds}"))))


def run_length(model, engine, length, args):
    prefix = prompts(1, length - TAIL, seed=40000 + length)[0]
    tails = prompts(args.rows, TAIL, seed=41000 + length)
    print(f"\n## {args.rows} rows at {length} tokens (shared prefix {length - TAIL}), "
          f"{args.rounds} rounds of {args.tokens} tokens")
    t = time.perf_counter()
    bg = BatchGeneratorRows(model, prefix, tails, 1 + args.rounds * args.tokens + 1)
    en = EngineRows(engine, prefix, tails)
    print(f"prefill of both: {time.perf_counter() - t:.0f} s")
    print(f"{'round':>5}  {'first':<15}{'BatchGenerator ms':>18}{'macfarm ms':>12}{'BG / macfarm':>14}")
    ratios = []
    for r in range(args.rounds):
        engine_first = r % 2 == 1
        if engine_first:
            e = en.round(args.tokens)
            b = bg.round(args.tokens)
        else:
            b = bg.round(args.tokens)
            e = en.round(args.tokens)
        ratios.append(b / e)
        print(f"{r:>5}  {'engine' if engine_first else 'BatchGenerator':<15}{1e3 * b:>18.1f}{1e3 * e:>12.1f}"
              f"{b / e:>13.2f}x")
    bg.close()
    n = min(len(bg.tokens[0]), len(en.tokens[0]))
    same = sum(b[:n] == e[:n] for b, e in zip(bg.tokens, en.tokens))
    print(f"{length}: full-batch decode step, BatchGenerator / macfarm: median {statistics.median(ratios):.2f}x "
          f"(rounds {min(ratios):.2f}-{max(ratios):.2f}); greedy tokens equal in {same} of {args.rows} rows "
          f"({n} tokens each)")
    return statistics.median(ratios)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="HF id, mlx-lm dir or .gguf (default: embedded SmolLM2-135M)")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--lens", type=int, nargs="+", default=[1536, 8192])
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--tokens", type=int, default=24, help="decode steps per round and system")
    args = ap.parse_args()
    if min(args.lens) <= TAIL:
        ap.error(f"--lens must exceed {TAIL}")
    model, tokenizer = load_model(args.model, args.dtype)
    engine = build_engine(model, tokenizer, "default", 64)
    print(f"model={args.model or 'default SmolLM2-135M-Instruct'} device={mx.default_device()} "
          f"engine pool {engine.pool.nbytes / 2**30:.2f} GiB (default)")
    try:
        results = {n: run_length(model, engine, n, args) for n in args.lens}
    finally:
        engine.shutdown()
    print("\n## Summary: full-batch decode step, BatchGenerator / macfarm (above 1: macfarm faster)")
    for n, r in results.items():
        print(f"{args.rows} x {n}: {r:.2f}x")


if __name__ == "__main__":
    main()

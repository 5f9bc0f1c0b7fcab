"""Engine benchmark: macfarm vs mlx-lm on the same model and dtype, in one run.

    python benchmarks/engine.py [--model PATH] [--dtype auto] [--concurrency 1 4 16]

Prints one table: end-to-end output tok/s (prefill included) and decode tok/s at each
concurrency for mlx_lm.stream_generate (batch 1), mlx-lm's BatchGenerator and the
engine; prefill tok/s; TTFT of a cold prompt vs one whose first 1,000 tokens are cached.
"""

import argparse
import asyncio
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx_worker  # noqa: E402  (OpenBLAS before mlx on Linux)
import mlx.core as mx  # noqa: E402
from mlx_lm import stream_generate  # noqa: E402
from mlx_lm.generate import BatchGenerator  # noqa: E402
from mlx_lm.sample_utils import make_sampler  # noqa: E402

from mlx_worker import Engine, EngineConfig, Request, SamplingParams  # noqa: E402
from mlx_worker.loader import load_model  # noqa: E402


def prompts(n, length, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(1000, 40000) for _ in range(length)] for _ in range(n)]


def bench_stream_generate(model, tokenizer, prompt, out_len):
    t0 = time.perf_counter()
    first = None
    n = 0
    for r in stream_generate(model, tokenizer, mx.array(prompt), max_tokens=out_len, sampler=make_sampler(0.0)):
        n += 1
        first = first or time.perf_counter()
        last = r
    t1 = time.perf_counter()
    return {"e2e": n / (t1 - t0), "decode": last.generation_tps, "prefill": last.prompt_tps, "ttft": first - t0}


def bench_batch_generator(model, ps, out_len):
    gen = BatchGenerator(model, stop_tokens=[], prefill_batch_size=len(ps), completion_batch_size=len(ps))
    t0 = time.perf_counter()
    gen.insert(ps, [out_len] * len(ps))
    n, first_all, n_at_first = 0, None, 0
    seen = set()
    with gen.stats() as stats:
        while responses := gen.next_generated():
            for r in responses:
                n += 1
                seen.add(r.uid)
            if first_all is None and len(seen) == len(ps):
                first_all, n_at_first = time.perf_counter(), n
    t1 = time.perf_counter()
    gen.close()
    return {"e2e": n / (t1 - t0), "decode": (n - n_at_first) / (t1 - first_all), "tokens": n}


def median(runs):
    return {k: statistics.median(r[k] for r in runs) for k in ("e2e", "decode")}


def bench_bare_forward(model, ps, out_len):
    """The ceiling for any engine on mlx-lm's models: one batched forward per step on
    mlx-lm's own KV cache, greedy argmax, no scheduling, sampling or streaming. Prompts
    must have equal lengths (no padding)."""
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    t0 = time.perf_counter()
    tok = mx.argmax(model(mx.array(ps), cache=cache)[:, -1, :], axis=-1)
    mx.eval(tok)
    t_first = time.perf_counter()
    for _ in range(out_len - 1):
        tok = mx.argmax(model(tok[:, None], cache=cache)[:, -1, :], axis=-1)
        mx.eval(tok)
    t1 = time.perf_counter()
    n = len(ps) * out_len
    return {"e2e": n / (t1 - t0), "decode": (n - len(ps)) / (t1 - t_first)}


async def _engine_run(engine, ps, out_len, tag, temperature=0.0, top_p=1.0):
    t0 = time.perf_counter()
    firsts, counts = {}, {}

    async def one(i, p):
        rid = f"{tag}-{i}"
        async for out in engine.generate(Request(rid=rid, prompt_ids=p, params=SamplingParams(max_tokens=out_len, ignore_eos=True, temperature=temperature, top_p=top_p))):
            counts[rid] = counts.get(rid, 0) + len(out.token_ids)
            firsts.setdefault(rid, time.perf_counter())
            if len(firsts) == len(ps) and "all" not in firsts:
                firsts["all"] = time.perf_counter()
                counts["at_all"] = sum(v for k, v in counts.items() if k != "at_all")

    await asyncio.gather(*[one(i, p) for i, p in enumerate(ps)])
    t1 = time.perf_counter()
    n = sum(v for k, v in counts.items() if k != "at_all")
    decode = (n - counts["at_all"]) / (t1 - firsts["all"]) if t1 > firsts["all"] else float("nan")
    ttft = min(v for k, v in firsts.items() if k != "all") - t0
    return {"e2e": n / (t1 - t0), "decode": decode, "tokens": n, "ttft": ttft}


def bench_engine(engine, ps, out_len, tag, temperature=0.0, top_p=1.0):
    return asyncio.run(_engine_run(engine, ps, out_len, tag, temperature, top_p))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="HF id, mlx-lm dir or .gguf (default: embedded SmolLM2-135M)")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--prefix-len", type=int, default=1000)
    ap.add_argument("--repeat", type=int, default=3, help="runs per system and concurrency; medians are printed")
    args = ap.parse_args()

    model, tokenizer = load_model(args.model, args.dtype)
    dtype = next(v.dtype for k, v in mlx_worker.engine.tree_flatten(model.parameters()) if "norm" in k)
    print(f"model={args.model or 'default SmolLM2-135M-Instruct'} dtype={dtype} device={mx.default_device()}")
    engine = Engine(EngineConfig(max_total_tokens=32768, max_running_requests=64), model=model, tokenizer=tokenizer)

    # Warm-up both paths once (graph caches, allocator).
    bench_stream_generate(model, tokenizer, prompts(1, 16, 99)[0], 4)
    bench_engine(engine, prompts(2, 16, 98), 4, "warm")

    rows = []
    sg = median([bench_stream_generate(model, tokenizer, prompts(1, args.prompt_len, 1 + r)[0], args.output_len)
                 for r in range(args.repeat)])
    rows.append(("stream_generate", 1, sg["e2e"], sg["decode"]))
    results = {}
    for c in args.concurrency:
        runs = []
        for r in range(args.repeat):  # interleaved, so drift in the machine's speed hits all three alike
            ps = prompts(c, args.prompt_len, seed=1000 * r + c)  # fresh prompts: no prefix-cache hits
            runs.append((bench_bare_forward(model, ps, args.output_len),
                         bench_batch_generator(model, ps, args.output_len),
                         bench_engine(engine, [p[:] for p in ps], args.output_len, f"c{c}r{r}")))
        bare, bg, en = (median([run[i] for run in runs]) for i in range(3))
        rows.append(("bare forward (ceiling)", c, bare["e2e"], bare["decode"]))
        rows.append(("mlx-lm BatchGenerator", c, bg["e2e"], bg["decode"]))
        rows.append(("macfarm engine", c, en["e2e"], en["decode"]))
        results[c] = (bg, en, bare)

    print(f"\n## Throughput ({args.prompt_len} prompt / {args.output_len} output tokens, greedy; "
          f"median of {args.repeat} interleaved runs)")
    print(f"{'system':<24}{'concurrency':>12}{'e2e tok/s':>12}{'decode tok/s':>14}")
    for name, c, e2e, dec in rows:
        print(f"{name:<24}{c:>12}{e2e:>12.1f}{dec:>14.1f}")
    print("\n## Ratios (e2e tok/s)")
    for c, (bg, en, bare) in results.items():
        print(f"concurrency {c:>3}: macfarm vs BatchGenerator {en['e2e'] / bg['e2e']:.2f}x   "
              f"of the ceiling: macfarm {en['e2e'] / bare['e2e']:.2f}, BatchGenerator {bg['e2e'] / bare['e2e']:.2f}")
    # Sampling cost: temperature + top-p at the highest concurrency (fresh prompts: no cache hits).
    c = max(args.concurrency)
    ps = prompts(c, args.prompt_len, seed=20 + c)
    greedy = results[c][1]
    samp = bench_engine(engine, [p[:] for p in ps], args.output_len, "samp", temperature=0.7, top_p=0.9)
    print(f"\n## Sampling cost at concurrency {c} (macfarm engine)")
    print(f"greedy {greedy['e2e']:.1f} tok/s e2e, {greedy['decode']:.1f} decode   "
          f"temperature 0.7 + top_p 0.9 {samp['e2e']:.1f} e2e, {samp['decode']:.1f} decode   "
          f"ratio {samp['decode'] / greedy['decode']:.2f}x (target >= 0.90x)")
    if 1 in results:
        en1 = results[1][1]
        print(f"batch 1 decode: vs stream_generate {en1['decode'] / sg['decode']:.2f}x "
              f"({en1['decode']:.1f} vs {sg['decode']:.1f} tok/s)")

    # Prefill speed: one long prompt, one output token.
    long = prompts(1, args.prefix_len + 24, seed=5)[0]
    sgp = bench_stream_generate(model, tokenizer, long, 1)
    t0 = time.perf_counter()
    bench_engine(engine, [long], 1, "prefill")
    en_prefill = len(long) / (time.perf_counter() - t0)
    print(f"\n## Prefill ({len(long)} tokens)")
    print(f"stream_generate {sgp['prefill']:.1f} tok/s   macfarm engine {en_prefill:.1f} tok/s")

    # TTFT with a cached prefix: a new prompt sharing the first prefix_len tokens.
    base = prompts(1, args.prefix_len, seed=6)[0]
    cold = bench_engine(engine, [base + prompts(1, 24, seed=7)[0]], 1, "cold")["ttft"]
    warm = bench_engine(engine, [base + prompts(1, 24, seed=8)[0]], 1, "warm")["ttft"]
    print(f"\n## TTFT with a {args.prefix_len}-token cached prefix")
    print(f"cold {cold * 1e3:.0f} ms   cached {warm * 1e3:.0f} ms   ratio {warm / cold:.3f}x (target <= 0.2x)")
    st = engine.stats()
    print(f"prefix hit tokens {st['prefix_hit_tokens']}  preemptions {st['preemptions']}")
    engine.shutdown()


if __name__ == "__main__":
    main()

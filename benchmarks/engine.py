"""Engine benchmark: macfarm vs mlx-lm on the same model and dtype, in one run.

    python benchmarks/engine.py [--model PATH | --arch qwen3_next] [--dtype auto] [--quick]
        [--scenarios uniform churn long mixed] [--pools 32768 default]

Scenarios, each run once per KV pool size (an engine with max_total_tokens=32768, and
one with EngineConfig's defaults, as deployed), built one at a time:
  uniform  end-to-end output tok/s (prefill included) and decode tok/s at each
           concurrency for mlx_lm.stream_generate (batch 1), mlx-lm's BatchGenerator,
           the engine and the bare forward; sampling cost; prefill tok/s; TTFT of a cold
           prompt vs one whose first 1,000 tokens are cached.
  churn    one seeded Poisson arrival schedule of mixed prompt and output lengths through
           the engine and BatchGenerator: tok/s, TTFT and inter-token latency.
  budget   the same churn schedule through the engine with steps sized in time (the
           default, step_budget.py) and in tokens (every step max_batched_tokens, as before
           it): tok/s and the token gap, p50 / p99.
  long     4 prompts of 1,536 and 4 of 8,192 tokens, all at once: e2e and decode tok/s, and
           the decode step while all 4 rows decode (the engine's rows start and end apart).
  host     host work per step at decode batches of 32 and 128 rows.
  mixed    whether a forward mixing unequal prompts (or a prefill with a decode) costs
           more than its tokens, and the MLX peak-memory growth of such a step.
Ends with a summary table: scenario x pool. --quick shrinks every size (a smoke run).
"""

import argparse
import asyncio
import gc
import statistics
import sys
import time
from collections import deque
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx_worker  # noqa: E402  (OpenBLAS before mlx on Linux)
import mlx.core as mx  # noqa: E402
from mlx_lm import stream_generate  # noqa: E402
from mlx_lm.generate import BatchGenerator  # noqa: E402
from mlx_lm.sample_utils import make_sampler  # noqa: E402

from mlx_worker import Engine, EngineConfig, Request, SamplingParams  # noqa: E402
from mlx_worker.models.loader import load_model  # noqa: E402
from common import pct  # noqa: E402
from traffic import Arrival, Trace, full_batch_itl, prompts, schedule, summarize  # noqa: E402  (benchmarks/traffic.py)
from random_models import CONFIGS as RANDOM_CONFIGS, random_model  # noqa: E402

SCENARIOS = ("uniform", "churn", "budget", "long", "host", "mixed")
# mlx_lm.server's BatchGenerator: --decode-concurrency, --prompt-concurrency, --prefill-step-size.
SERVER_BG = dict(completion_batch_size=32, prefill_batch_size=8, prefill_step_size=2048)
FULL = dict(prompt_len=128, output_len=128, concurrency=[1, 4, 16], prefix_len=1000, repeat=3,
            requests=40, rate=0.32, churn_prompt=[16, 1536], churn_output=[16, 256],
            long_lens=[1536, 8192], long_n=4, long_output=48, mixed_len=200, host_rows=[32, 128])
QUICK = dict(prompt_len=32, output_len=8, concurrency=[1, 4], prefix_len=128, repeat=1,
             requests=6, rate=2.0, churn_prompt=[16, 128], churn_output=[4, 16],
             long_lens=[128, 256], long_n=4, long_output=8, mixed_len=48, host_rows=[32])


def params(max_tokens, temperature=0.0, top_p=1.0):
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=temperature, top_p=top_p)


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
        async for out in engine.generate(Request(rid=rid, prompt_ids=p, params=params(out_len, temperature, top_p))):
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
    return {"e2e": n / (t1 - t0), "decode": decode, "tokens": n, "ttft": ttft, "wall": t1 - t0}


def bench_engine(engine, ps, out_len, tag, temperature=0.0, top_p=1.0):
    return asyncio.run(_engine_run(engine, ps, out_len, tag, temperature, top_p))


# --- arrivals over time -----------------------------------------------------------------
async def _engine_schedule(engine, sched, tag):
    trace = Trace.begin(time.perf_counter(), sched)

    async def one(i, a):
        await asyncio.sleep(max(0.0, trace.arrivals[i] - time.perf_counter()))
        async for out in engine.generate(Request(rid=f"{tag}-{i}", prompt_ids=a.prompt[:], params=params(a.max_tokens))):
            trace.tokens[i].extend([time.perf_counter()] * len(out.token_ids))

    await asyncio.gather(*[one(i, a) for i, a in enumerate(sched)])
    return trace


def engine_schedule(engine, sched, tag):
    """Run the schedule through the engine: one task per request, started at its arrival."""
    return asyncio.run(_engine_schedule(engine, sched, tag))


def batch_generator_schedule(model, sched):
    """Run the schedule through BatchGenerator as mlx_lm.server drives it: requests that
    have arrived are inserted between `next()` calls."""
    gen = BatchGenerator(model, stop_tokens=[], **SERVER_BG)
    trace = Trace.begin(time.perf_counter(), sched)
    pending, live = deque(range(len(sched))), {}  # live: uid -> request index
    while pending or live:
        now = time.perf_counter()
        while pending and trace.arrivals[pending[0]] <= now:
            i = pending.popleft()
            live[gen.insert([sched[i].prompt], [sched[i].max_tokens])[0]] = i
        if not live:
            time.sleep(max(0.0, trace.arrivals[pending[0]] - now))
            continue
        _, responses = gen.next()
        t = time.perf_counter()
        for r in responses:
            trace.tokens[live[r.uid]].append(t)
            if r.finish_reason is not None:
                del live[r.uid]
    gen.close()
    return trace


# --- engine counters ----------------------------------------------------------------------
def counters(engine):
    s = engine.stats()
    return {"steps": s["steps"], "host_ms": s["host_ms_per_step"] * s["steps"],
            "build_ms": s["graph_build_ms_per_step"] * s["steps"], "host_cpu_ms": s["host_cpu_ms_per_step"] * s["steps"],
            "build_cpu_ms": s["graph_build_cpu_ms_per_step"] * s["steps"], "staged": s["decode_steps_staged"],
            "gathered": s["decode_steps_gathered"], "restaged": s["decode_steps_restaged"],
            "preemptions": s["preemptions"]}


TIMES = ("host_ms", "build_ms", "host_cpu_ms", "build_cpu_ms")  # engine-thread times, wall and CPU


def since(before, engine):
    """Counter deltas since `before`, and the host ms per step over that span."""
    d = {k: v - before[k] for k, v in counters(engine).items()}
    for k in TIMES:
        d[f"{k}_per_step"] = d[k] / d["steps"] if d["steps"] else float("nan")
    return d


def print_counters(d):
    print(f"engine: {d['steps']} steps, host {d['host_ms_per_step']:.2f} ms/step, decode steps staged "
          f"{d['staged']} (restaged {d['restaged']}) / gathered {d['gathered']}, preemptions {d['preemptions']}")


# --- scenarios: each prints its section and returns rows for the summary -------------------
def run_uniform(engine, model, tokenizer, args):
    before = counters(engine)
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
    en_prefill = len(long) / bench_engine(engine, [long], 1, "prefill")["wall"]
    print(f"\n## Prefill ({len(long)} tokens)")
    print(f"stream_generate {sgp['prefill']:.1f} tok/s   macfarm engine {en_prefill:.1f} tok/s")

    # TTFT with a cached prefix: new prompts sharing the first prefix_len tokens. A model
    # with recurrent layers resumes only at a state snapshot: the second prompt leaves one
    # where it branches from the first, and the third resumes there.
    base = prompts(1, args.prefix_len, seed=6)[0]
    cold, second, warm = (bench_engine(engine, [base + prompts(1, 24, seed=7 + i)[0]], 1, f"ttft{i}")["ttft"]
                          for i in range(3))
    print(f"\n## TTFT with a {args.prefix_len}-token cached prefix")
    print(f"cold {cold * 1e3:.0f} ms   second prompt {second * 1e3:.0f} ms   cached (third) {warm * 1e3:.0f} ms   "
          f"ratio {warm / cold:.3f}x (target <= 0.2x)")
    st = engine.stats()
    print(f"prefix hit tokens {st['prefix_hit_tokens']}  preemptions {st['preemptions']}")
    d = since(before, engine)
    print_counters(d)
    bg, en, _ = results[c]
    return [{"scenario": f"uniform c={c}", "e2e": en["e2e"] / bg["e2e"], "decode": en["decode"] / bg["decode"],
             "host": d["host_ms_per_step"]}]


def run_churn(engine, model, args):
    sched = schedule(args.requests, args.rate, args.churn_prompt, args.churn_output, seed=args.seed)
    print(f"\n## Churn: {args.requests} requests, Poisson {args.rate}/s (seed {args.seed}, arrivals over "
          f"{sched[-1].at:.0f} s), prompts {args.churn_prompt[0]}..{args.churn_prompt[1]}, outputs "
          f"{args.churn_output[0]}..{args.churn_output[1]} tokens, greedy, EOS ignored")
    bg = summarize(batch_generator_schedule(model, sched))
    before = counters(engine)
    en = summarize(engine_schedule(engine, sched, "churn"))
    d = since(before, engine)
    print(f"{'system':<24}{'tok/s':>8}{'TTFT p50':>10}{'p95 ms':>8}{'ITL p50':>9}{'p95':>7}{'max ms':>8}"
          f"{'in flight':>11}{'span s':>8}")
    for name, s in (("mlx-lm BatchGenerator", bg), ("macfarm engine", en)):
        ms = {k: 1e3 * s[k] for k in ("ttft_p50", "ttft_p95", "itl_p50", "itl_p95", "itl_max")}
        print(f"{name:<24}{s['tok_s']:>8.1f}{ms['ttft_p50']:>10.0f}{ms['ttft_p95']:>8.0f}{ms['itl_p50']:>9.0f}"
              f"{ms['itl_p95']:>7.0f}{ms['itl_max']:>8.0f}{s['in_flight']:>11.1f}{s['span']:>8.1f}")
    r = {k: en[k] / bg[k] for k in ("tok_s", "ttft_p50", "ttft_p95", "itl_p50", "itl_p95", "itl_max")}
    print("macfarm/BatchGenerator: " + "  ".join(f"{k} {v:.2f}x" for k, v in r.items()))
    print_counters(d)
    return [{"scenario": "churn", "e2e": r["tok_s"], "ttft": r["ttft_p50"],
             "itl": (1e3 * en["itl_p95"], 1e3 * bg["itl_p95"]), "host": d["host_ms_per_step"]}]


def run_budget(model, tokenizer, pool, args):
    sched = schedule(args.requests, args.rate, args.churn_prompt, args.churn_output, seed=args.seed)
    print(f"\n## Step budget in time vs in tokens: churn, {args.requests} requests, Poisson {args.rate}/s, prompts "
          f"{args.churn_prompt[0]}..{args.churn_prompt[1]}, outputs {args.churn_output[0]}..{args.churn_output[1]}")
    print(f"{'step budget':<14}{'tok/s':>8}{'TTFT p50 ms':>13}{'gap p50 ms':>12}{'p99':>8}{'max':>8}{'span s':>8}")
    res = {}
    for budget in ("tokens", "time"):
        engine = build_engine(model, tokenizer, pool, 64, step_budget=budget)
        trace = engine_schedule(engine, sched, f"budget-{budget}")
        engine.shutdown()
        s, gaps = summarize(trace), [y - x for t in trace.tokens for x, y in zip(t, t[1:])]
        res[budget] = {**s, "gap_p99": pct(gaps, 0.99)}
        print(f"{budget:<14}{s['tok_s']:>8.1f}{1e3 * s['ttft_p50']:>13.0f}{1e3 * s['itl_p50']:>12.0f}"
              f"{1e3 * res[budget]['gap_p99']:>8.0f}{1e3 * s['itl_max']:>8.0f}{s['span']:>8.1f}")
    t, k = res["time"], res["tokens"]
    print(f"time / tokens: tok/s {t['tok_s'] / k['tok_s']:.2f}x (target >= 0.95x), gap p99 "
          f"{t['gap_p99'] / k['gap_p99']:.2f}x")
    return [{"scenario": "budget", "e2e": t["tok_s"] / k["tok_s"], "itl": (1e3 * t["gap_p99"], 1e3 * k["gap_p99"])}]


def run_long(engine, model, args):
    first = "engine" if args.long_engine_first else "BatchGenerator"
    print(f"\n## Long context ({args.long_n} prompts at once, {args.long_output} output tokens each, greedy; "
          f"{first} runs first)")
    print("decode: tok/s after every request has its first token; full-batch step: median gap between a "
          "request's tokens while all of them decode")
    print(f"{'prompt':>7}  {'system':<24}{'e2e tok/s':>10}{'decode tok/s':>14}{'full-batch step ms':>20}")
    rows = []
    for n in args.long_lens:
        sched = [Arrival(0.0, p, args.long_output) for p in prompts(args.long_n, n, seed=30000 + n)]
        if not args.long_engine_first:
            bg = batch_generator_schedule(model, sched)
        before = counters(engine)
        en = engine_schedule(engine, sched, f"long{n}")
        d = since(before, engine)
        if args.long_engine_first:
            bg = batch_generator_schedule(model, sched)
        stats = {}
        for name, trace in (("mlx-lm BatchGenerator", bg), ("macfarm engine", en)):
            s = stats[name] = {**summarize(trace), **after_first(trace), "step": statistics.median(full_batch_itl(trace))}
            print(f"{n:>7}  {name:<24}{s['tok_s']:>10.1f}{s['decode']:>14.1f}{1e3 * s['step']:>20.0f}")
        b, e = stats["mlx-lm BatchGenerator"], stats["macfarm engine"]
        r = {"e2e": e["tok_s"] / b["tok_s"], "decode": b["step"] / e["step"], "after_first": e["decode"] / b["decode"]}
        print(f"{n:>7}  macfarm/BatchGenerator: e2e {r['e2e']:.2f}x  full-batch decode {r['decode']:.2f}x "
              f"(after every first token {r['after_first']:.2f}x)")
        print_counters(d)
        rows.append({"scenario": f"long {n}", "e2e": r["e2e"], "decode": r["decode"], "host": d["host_ms_per_step"]})
    return rows


def after_first(trace):
    """Output tok/s from the moment every request has its first token to the last token."""
    t_all = max(t[0] for t in trace.tokens)
    end = max(t[-1] for t in trace.tokens)
    n = sum(1 for t in trace.tokens for x in t if x > t_all)
    return {"decode": n / (end - t_all)}


def graph_build_ms(model, rows, steps=20):
    """Median time to build (not run) one decode step's graph of mlx-lm's own model on
    its own KV cache: the part of host work no engine on unmodified models avoids."""
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    mx.eval(model(mx.array(prompts(rows, 16, seed=7)), cache=cache))
    tok, times = mx.zeros((rows, 1), mx.int32), []
    for _ in range(steps):
        t = time.perf_counter()
        out = model(tok, cache=cache)
        times.append(time.perf_counter() - t)
        mx.eval(out)
    return 1e3 * statistics.median(times)


def run_host(engine, model, args):
    """Host work per step (scheduling, graph building, token handling, delivery: the
    engine thread's time not spent dispatching to or waiting for the device) at decode
    batches of `host_rows` rows (16-token prompts, 64 output tokens). Of it, building
    the model's graph is mlx-lm's code (the engine's `graph_build_ms_per_step`; mlx-lm's
    own loop's build time is printed beside it); the rest is the engine's share. With
    overlap the next step is built while the forward runs on the same two cores, which
    slows both; without overlap the host work runs alone, as it would beside a GPU. The
    engine thread's CPU time over the same spans (`host_cpu_ms_per_step`) is printed
    beside the wall time: the gap is the thread waiting for a core the forward holds.
    Runs with overlap on and off alternate, --repeat times; medians are printed, with
    the spread (a sub-millisecond figure moves with whatever else the CPU and glibc's
    allocator are doing)."""
    print(f"\n## Host work per decode step (engine thread, device time excluded; median of {args.repeat})")
    rows = []
    for n in args.host_rows:
        target = 2.0 if n <= 32 else 4.0 * n / 128
        runs = {True: [], False: []}
        for r in range(args.repeat):
            for overlap in (True, False):
                engine.config.overlap = overlap
                before = counters(engine)
                bench_engine(engine, prompts(n, 16, seed=60000 + n), 64, f"host{n}{overlap}{r}")
                d = since(before, engine)
                runs[overlap].append({k: d[f"{k}_per_step"] for k in TIMES})
        engine.config.overlap = True
        measured = {}
        for overlap in (True, False):
            med = {k: statistics.median(r[k] for r in runs[overlap]) for k in runs[overlap][0]}
            shares = sorted(r["host_ms"] - r["build_ms"] for r in runs[overlap])
            share = statistics.median(shares)
            cpu_share = statistics.median(r["host_cpu_ms"] - r["build_cpu_ms"] for r in runs[overlap])
            print(f"{n:>4} rows, overlap {'on ' if overlap else 'off'}: {med['host_ms']:.2f} ms/step; of it building the "
                  f"model's graph {med['build_ms']:.2f} ms, the engine's share {share:.2f} ms (runs {shares[0]:.2f}-"
                  f"{shares[-1]:.2f}; target <= {target:.1f}); in CPU time {med['host_cpu_ms']:.2f} ms, of it graph "
                  f"{med['build_cpu_ms']:.2f}, the engine's share {cpu_share:.2f} ms")
            rows.append({"scenario": f"host {n}{'' if overlap else ' seq'}", "host": med["host_ms"], "share": share,
                         "cpu_share": cpu_share})
            measured[overlap] = (med["build_ms"], share)
        (build_on, share_on), (build_off, share_off) = measured[True], measured[False]
        print(f"      overlap on / off: mlx-lm's graph build x{build_on / build_off:.2f}, the engine's share "
              f"x{share_on / share_off:.2f}")
        print(f"      mlx-lm's own graph build for {n} rows (its KV cache, nothing else running): "
              f"{graph_build_ms(model, n):.2f} ms")
    return rows


async def _join_while_decoding(engine, prompt, seed):
    """Seconds from submitting `prompt` (one output token) to its token, while another
    request is decoding; the other request is aborted afterwards."""
    decoding = asyncio.Event()

    async def background():
        req = Request(rid=f"bg{seed}", prompt_ids=prompts(1, 16, seed)[0], params=params(100_000))
        n = 0
        async for out in engine.generate(req):
            n += len(out.token_ids)
            if n >= 4:
                decoding.set()

    task = asyncio.create_task(background())
    await decoding.wait()
    t0 = time.perf_counter()
    async for _ in engine.generate(Request(rid=f"join{seed}", prompt_ids=prompt, params=params(1))):
        pass
    dt = time.perf_counter() - t0
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    return dt


def run_mixed(engine, args):
    """(a) prompts of n and n+1 tokens in one step vs (b) n and n (same tokens, equal
    lengths); (c) an n-token prompt joining a decoding request vs alone. Fresh prompts
    throughout (no prefix-cache hits); medians of --repeat runs."""
    n, seeds = args.mixed_len, iter(range(40000, 50000))

    def fresh(*lens):
        return [prompts(1, k, seed=next(seeds))[0] for k in lens]

    def wall(ps, tag):
        return bench_engine(engine, ps, 1, tag)["wall"]

    before = counters(engine)
    a, b, c, solo, peak = [], [], [], [], []
    for r in range(args.repeat):
        gc.collect()  # arrays of earlier runs freed now, not during (a)
        mx.synchronize()
        mx.reset_peak_memory()
        base = mx.get_active_memory()
        a.append(wall(fresh(n, n + 1), f"mixa{r}"))
        peak.append((mx.get_peak_memory() - base) / 2**20)
        b.append(wall(fresh(n, n), f"mixb{r}"))
        c.append(asyncio.run(_join_while_decoding(engine, fresh(n)[0], next(seeds))))
        wall(fresh(8), f"flush{r}")  # a step after the abort: the decoding request is gone
        solo.append(wall(fresh(n), f"solo{r}"))
    d = since(before, engine)
    a, b, c, solo = (statistics.median(x) for x in (a, b, c, solo))
    pool = engine.pool.nbytes / 2**20
    print(f"\n## Mixed step (one output token each; median of {args.repeat})")
    print(f"(a) {n} + {n + 1} tokens together {a * 1e3:.0f} ms   (b) {n} + {n} {b * 1e3:.0f} ms   "
          f"ratio (a)/(b) {a / b:.2f}x (target <= 1.3x)")
    print(f"(c) {n}-token prompt joining a decoding request {c * 1e3:.0f} ms   alone {solo * 1e3:.0f} ms   "
          f"ratio {c / solo:.2f}x")
    note = " (below 0: the peak stayed under the memory active before the step)" if max(peak) < 0 else ""
    print(f"MLX peak-memory growth during (a): max {max(peak):.1f} MiB{note}   KV pool {pool:.0f} MiB")
    print_counters(d)
    return [{"scenario": "mixed", "mixed": a / b, "peak": max(peak), "host": d["host_ms_per_step"]}]


# --- driver -------------------------------------------------------------------------------
def build_engine(model, tokenizer, pool, max_running, **config):
    """An engine with a pool of `pool` tokens, or EngineConfig's default pool ("default")."""
    size = {} if pool == "default" else {"max_total_tokens": int(pool)}
    engine = Engine(EngineConfig(max_running_requests=max_running, **size, **config), model=model, tokenizer=tokenizer)
    bench_engine(engine, prompts(2, 16, 98), 4, "warm")  # graph caches, allocator
    return engine


def print_summary(rows):
    def f(v, spec):
        return "-" if v is None else format(v, spec)

    print("\n## Summary (x: macfarm / BatchGenerator; ITL p95 ms: macfarm / BatchGenerator)")
    print(f"{'scenario':<16}{'pool':>9}{'e2e x':>8}{'decode x':>10}{'TTFT p50 x':>12}{'ITL p95 ms':>13}"
          f"{'host ms/step':>14}{'of it engine':>14}{'engine CPU':>12}{'mixed x':>9}{'peak MiB':>10}")
    for r in rows:
        itl = "-" if "itl" not in r else f"{r['itl'][0]:.0f} / {r['itl'][1]:.0f}"
        print(f"{r['scenario']:<16}{r['pool']:>9}{f(r.get('e2e'), '.2f'):>8}{f(r.get('decode'), '.2f'):>10}"
              f"{f(r.get('ttft'), '.2f'):>12}{itl:>13}{f(r.get('host'), '.2f'):>14}{f(r.get('share'), '.2f'):>14}"
              f"{f(r.get('cpu_share'), '.2f'):>12}{f(r.get('mixed'), '.2f'):>9}{f(r.get('peak'), '.1f'):>10}")


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])

    def sized(flag, help, **kw):  # default from FULL, or QUICK under --quick
        key = flag[2:].replace("-", "_")
        ap.add_argument(flag, default=None, help=f"{help} (default {FULL[key]}; --quick {QUICK[key]})", **kw)

    ap.add_argument("--model", default=None, help="HF id, mlx-lm dir or .gguf (default: embedded SmolLM2-135M)")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--arch", default=None, choices=sorted(RANDOM_CONFIGS),
                    help="instead of --model: random weights of this architecture at ~100M parameters "
                         "(benchmarks/random_models.py), with the default model's tokenizer")
    ap.add_argument("--scenarios", nargs="+", choices=SCENARIOS, default=list(SCENARIOS))
    ap.add_argument("--pools", nargs="+", default=["32768", "default"],
                    help="KV pool sizes in tokens, or 'default' (EngineConfig's kv_memory_fraction)")
    ap.add_argument("--quick", action="store_true", help="small sizes: a smoke run")
    ap.add_argument("--seed", type=int, default=0, help="churn schedule seed")
    sized("--prompt-len", "uniform prompt tokens", type=int)
    sized("--output-len", "uniform output tokens", type=int)
    sized("--concurrency", "uniform concurrencies", type=int, nargs="+")
    sized("--prefix-len", "cached-prefix tokens (and the prefill prompt)", type=int)
    sized("--repeat", "runs per uniform system, mixed-step case and host-work setting; medians are printed", type=int)
    sized("--requests", "churn requests", type=int)
    sized("--rate", "churn arrivals per second", type=float)
    sized("--churn-prompt", "churn prompt tokens, LO HI", type=int, nargs=2)
    sized("--churn-output", "churn output tokens, LO HI", type=int, nargs=2)
    sized("--long-lens", "long-context prompt lengths (e.g. drop 8192)", type=int, nargs="+")
    sized("--long-n", "long-context prompts per length", type=int)
    sized("--long-output", "long-context output tokens", type=int)
    ap.add_argument("--long-engine-first", action="store_true",
                    help="long context: run the engine before BatchGenerator (a 4 x 8,192 run takes ~30 min, "
                         "and the box's speed drifts over that long; run both orders to see the drift)")
    sized("--mixed-len", "mixed-step prompt tokens n (n + n+1 vs n + n)", type=int)
    sized("--host-rows", "decode batch sizes for the host-work section", type=int, nargs="+")
    args = ap.parse_args()
    for k, v in (QUICK if args.quick else FULL).items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    for p in args.pools:
        if p != "default" and not p.isdigit():
            ap.error(f"--pools: {p!r} is neither a token count nor 'default'")
    return args


def main():
    args = parse_args()
    model, tokenizer = load_model(args.model, args.dtype)
    if args.arch:
        model = random_model(args.arch)
    dtype = next(v.dtype for k, v in mlx_worker.engine.tree_flatten(model.parameters()) if "norm" in k)
    name = f"random {args.arch}" if args.arch else args.model or "default SmolLM2-135M-Instruct"
    print(f"model={name} dtype={dtype} device={mx.default_device()}")
    # Warm-up the mlx-lm paths once (graph caches, allocator).
    bench_stream_generate(model, tokenizer, prompts(1, 16, 99)[0], 4)
    bench_batch_generator(model, prompts(2, 16, 97), 4)

    summary = []
    for pool in args.pools:
        engine = build_engine(model, tokenizer, pool, max(64, *args.host_rows))
        print(f"\n# KV pool {pool}: {engine.pool.nbytes / 2**30:.2f} GiB, "
              f"{engine.stats()['kv_pages_total'] * engine.stats()['page_size']} tokens")
        runs = {"uniform": lambda: run_uniform(engine, model, tokenizer, args),
                "churn": lambda: run_churn(engine, model, args),
                "budget": lambda: run_budget(model, tokenizer, pool, args),
                "long": lambda: run_long(engine, model, args),
                "host": lambda: run_host(engine, model, args),
                "mixed": lambda: run_mixed(engine, args)}  # last: its aborted request never overlaps others
        for name in SCENARIOS:
            if name in args.scenarios:
                summary += [{**row, "pool": pool} for row in runs[name]()]
        engine.shutdown()
        del engine, runs
        gc.collect()
        mx.clear_cache()
    print_summary(summary)


if __name__ == "__main__":
    main()

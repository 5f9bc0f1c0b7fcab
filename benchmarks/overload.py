"""The deployed app under overload: `serve run deploy/app.yaml` as shipped (only its HTTP
port moved to loopback), driven past what the box can serve.

    python benchmarks/overload.py                     # every phase, ~25 minutes here
    python benchmarks/overload.py --phases closed --loops 16 64 --seconds 120 300
    python benchmarks/overload.py --phases gap --engine min_prefill_tokens=32   # one key changed

Phases (clients: benchmarks/load_clients.py; each try gives up after --timeout s):
  closed   N closed client loops for T s each (16 for 2 minutes, then 64 for 5).
  poisson  open-loop Poisson arrivals at 0.5x, 1x and 2x the capacity measured by the
           first closed phase (its goodput), --poisson-seconds each, no retries.
  gap      token gap of 8 streams decoding alone, then of the same 8 streams while long
           prompts arrive: the step budget's promise.
Prints per phase: goodput (requests completed within the timeout, per second), lost
(admitted, never completed), refused, wasted tokens (computed for requests then aborted
or failed, of all computed), TTFT and token-gap p50/p99, latency, and Retry-After
accuracy (the share of retries, sent after the Retry-After, that were admitted).
"""

import argparse
import asyncio
import random
import sys
import time
from pathlib import Path

import httpx
import yaml
from openai import AsyncOpenAI

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from load_clients import WORDS, canary_ok, run_arrivals, run_load  # noqa: E402
from common import deployed_app, ms, pct  # noqa: E402


def stats(base):
    return httpx.get(f"{base}/v1/stats", timeout=60).json()["replica"]


def wait_idle(base, timeout=600):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        st = stats(base)
        if st["running"] == 0 and st["waiting"] == 0:
            return st
        time.sleep(1)
    raise TimeoutError("the engine did not drain")


HEADER = (f"{'phase':<22}{'done':>6}{'goodput/s':>10}{'lost':>6}{'refused':>8}{'429s':>6}{'retry ok':>9}"
          f"{'wasted':>8}{'lat p50':>8}{'p99 s':>7}{'TTFT p50':>9}{'p99 ms':>8}{'gap p50':>8}{'p99 ms':>8}")


def row(name, res, span, st0, st1):
    computed = st1["tokens_computed"] - st0["tokens_computed"]
    wasted = (st1["tokens_wasted"] - st0["tokens_wasted"]) / max(1, computed)
    retries = res.retries_admitted + res.retries_refused
    lat = res.latencies
    print(f"{name:<22}{len(lat):>6}{len(lat) / span:>10.3f}{res.lost:>6}{res.refused:>8}{res.refusals:>6}"
          f"{(f'{res.retries_admitted / retries:.2f}' if retries else '-'):>9}{100 * wasted:>7.1f}%"
          f"{pct(lat, 0.5):>8.1f}{pct(lat, 0.99):>7.1f}{ms(res.ttfts, 0.5):>9}{ms(res.ttfts, 0.99):>8}"
          f"{ms(res.gaps, 0.5):>8}{ms(res.gaps, 0.99):>8}", flush=True)
    for e in res.errors[:5]:
        print("   lost:", e)
    if not canary_ok(res):
        print("   CANARY ANSWERS DIFFER:", res.canaries)
    return {"goodput": len(lat) / span, "lost": res.lost, "wasted": wasted}


def phase(base, name, run, *args):
    st0 = wait_idle(base)
    t0 = time.perf_counter()
    res = run(base, *args)
    span = time.perf_counter() - t0
    st1 = stats(base)
    return row(name, res, span, st0, st1), st1


async def streams_gap(base, arrivals_rate, seconds=60, n=8):
    """Token gaps of n streams while everything decodes (after the last first token,
    before the first last token), with prompts arriving at `arrivals_rate` meanwhile."""
    client = AsyncOpenAI(base_url=f"{base}/v1", api_key="unused", timeout=600, max_retries=0)
    model = (await client.models.list()).data[0].id
    stamps = [[] for _ in range(n)]

    async def stream(i):
        r = await client.completions.create(model=model, prompt=f"Story {i}: once upon a time", max_tokens=400,
                                            temperature=0, stream=True, extra_body={"ignore_eos": True})
        async for chunk in r:
            if chunk.choices:
                stamps[i].append(time.perf_counter())

    arrivals = []

    async def arrive():
        rng = random.Random(1)
        until = time.monotonic() + seconds
        while arrivals_rate and time.monotonic() < until:
            await asyncio.sleep(rng.expovariate(arrivals_rate))
            text = " ".join(rng.choice(WORDS) for _ in range(rng.randrange(300, 1200)))
            arrivals.append(asyncio.create_task(client.completions.create(model=model, prompt=text, max_tokens=4)))

    await asyncio.gather(*[stream(i) for i in range(n)], arrive())
    await asyncio.gather(*arrivals, return_exceptions=True)  # before the client closes under them
    start, end = max(s[0] for s in stamps), min(s[-1] for s in stamps)
    await client.close()
    return [y - x for s in stamps for x, y in zip(s, s[1:]) if start <= x and y <= end]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--phases", nargs="+", default=["closed", "poisson", "gap"])
    ap.add_argument("--loops", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--seconds", type=float, nargs="+", default=[120, 300], help="per closed phase")
    ap.add_argument("--poisson-seconds", type=float, default=180)
    ap.add_argument("--rates", type=float, nargs="+", default=[0.5, 1.0, 2.0], help="x the measured capacity")
    ap.add_argument("--capacity", type=float, help="requests/s (default: the first closed phase's goodput)")
    ap.add_argument("--timeout", type=float, default=120, help="each try gives up after this many seconds")
    ap.add_argument("--engine", nargs="+", default=[], metavar="KEY=VALUE",
                    help="engine config keys to change from deploy/app.yaml's (values as YAML)")
    a = ap.parse_args()
    overrides = {k: yaml.safe_load(v) for k, v in (kv.split("=", 1) for kv in a.engine)}
    with deployed_app(overrides) as base:
        httpx.get(f"{base}/v1/stats", timeout=60)
        changed = "".join(f", {k}={v}" for k, v in overrides.items())
        print(f"\n## deploy/app.yaml under overload{changed}; client timeout {a.timeout:.0f} s\n{HEADER}")
        capacity, results = a.capacity, {}
        if "closed" in a.phases:
            for loops, seconds in zip(a.loops, a.seconds):
                results[loops], st = phase(base, f"{loops} loops x {seconds:.0f} s", run_load, loops, seconds, a.timeout)
                capacity = capacity or results[loops]["goodput"]
            if len(a.loops) > 1:
                lo, hi = results[a.loops[0]], results[a.loops[-1]]
                print(f"goodput at {a.loops[-1]} loops / at {a.loops[0]}: {hi['goodput'] / lo['goodput']:.2f}x "
                      f"(target >= 0.9x)")
        if "poisson" in a.phases and capacity:
            for x in a.rates:
                r, st = phase(base, f"Poisson {x:g}x ({x * capacity:.2f}/s)", run_arrivals, x * capacity,
                              a.poisson_seconds, a.timeout)
                print(f"   goodput / capacity {r['goodput'] / capacity:.2f}x")
        if "gap" in a.phases:
            wait_idle(base)
            alone = asyncio.run(streams_gap(base, 0))
            wait_idle(base)
            busy = asyncio.run(streams_gap(base, 0.3))
            print(f"\n8 streams' token gap, decode only: p50 {ms(alone, 0.5)} p99 {ms(alone, 0.99)} ms; while "
                  f"prompts arrive (0.3/s, 300-1,200 words): p50 {ms(busy, 0.5)} p99 {ms(busy, 0.99)} ms; "
                  f"ratio of p99s {pct(busy, 0.99) / pct(alone, 0.99):.2f}x (target <= 2x)")
        st = stats(base)
        print("engine: " + ", ".join(f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}" for k, v in st.items()
                                     if k.startswith(("step", "mixed", "prefill_tokens", "token", "completion",
                                                      "refused", "withdrawn", "steps", "decode_only", "late"))))


if __name__ == "__main__":
    main()

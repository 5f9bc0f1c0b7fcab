"""The deployed app under concurrent clients: `serve run deploy/app.yaml` as shipped
(only the HTTP port moved to loopback), N client loops of mixed chat and completion
requests (streamed and not, prompts of a few words to ~1,500 tokens) for T seconds,
and /v1/stats polled throughout.

    python benchmarks/served_load.py --loops 64 --seconds 300

Prints completed requests, latency percentiles, output tok/s, /v1/stats latency, the
engine's counters, and its busy time per completed request D: with N closed client
loops and the engine the bottleneck, Little's law puts the mean latency near N x D.
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from load_clients import run_load  # noqa: E402
from common import deployed_app, pct  # noqa: E402


def engine_busy_s(st):
    """The engine thread's time in steps (host work + device dispatch and wait) since start."""
    return st["steps"] * (st["host_ms_per_step"] + st["device_ms_per_step"]) / 1e3


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--loops", type=int, default=64)
    ap.add_argument("--seconds", type=float, default=300)
    ap.add_argument("--timeout", type=float, default=600, help="a request slower than this counts as failed")
    a = ap.parse_args()
    with deployed_app() as base:
        st0 = httpx.get(f"{base}/v1/stats", timeout=60).json()["replica"]
        t0 = time.perf_counter()
        res = run_load(base, a.loops, a.seconds, a.timeout)
        span = time.perf_counter() - t0
        st = httpx.get(f"{base}/v1/stats", timeout=60).json()["replica"]
    lat, sl = res.latencies, res.stats_latencies
    print(f"\n## deploy/app.yaml, {a.loops} client loops for {a.seconds:.0f} s")
    print(f"requests completed {len(lat)}, failed {len(res.errors)}; output tokens {res.output_tokens}; "
          f"429 answers {res.refusals} (the openai client retries each twice, after Retry-After)")
    print(f"latency s: p50 {statistics.median(lat):.1f}  p95 {pct(lat, 0.95):.1f}  max {max(lat):.1f}  "
          f"(over 60 s: {sum(x > 60 for x in lat)})")
    print(f"/v1/stats ms: p50 {1e3 * statistics.median(sl):.0f}  p95 {1e3 * pct(sl, 0.95):.0f}  max {1e3 * max(sl):.0f}")
    busy_s = engine_busy_s(st) - engine_busy_s(st0)
    busy = busy_s / max(1, len(lat))
    print(f"engine busy {busy:.2f} s per completed request ({100 * busy_s / span:.0f}% "
          f"of the run): by Little's law {a.loops} loops wait about {a.loops} x {busy:.2f} = "
          f"{a.loops * busy:.0f} s a request here (measured mean {statistics.mean(lat):.1f} s)")
    budget = sum(st[k] for k in ("weights_bytes", "kv_pool_bytes", "decode_staging_budget_bytes",
                                 "activation_budget_bytes"))
    print(f"peak memory {st['peak_memory_bytes'] / 2**30:.2f} GiB, bound {budget / 2**30:.2f} GiB "
          f"(weights + pool + decode staging + activations)")
    print("engine: " + ", ".join(f"{k} {v:.1f}" if isinstance(v, float) else f"{k} {v}" for k, v in st.items()))
    for e in res.errors[:5]:
        print("error:", e)


if __name__ == "__main__":
    main()

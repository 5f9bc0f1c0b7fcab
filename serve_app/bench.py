"""Benchmark an OpenAI-compatible endpoint: streamed requests, TTFT/ITL/throughput percentiles.

    python -m serve_app.bench --base-url http://127.0.0.1:8000/v1 --workload tenants \\
        --num-requests 200 --concurrency 16 --out results/run.json --plot results/run.png

Workloads (lengths are fixed with `ignore_eos` and `max_tokens`):
  fixed    /v1/completions, prompts of exactly P random token ids in [1000, 20000)
  tenants  /v1/chat/completions, T system prompts of ~X words, each request a short user
           turn under a random tenant (measures the prefix cache)
  chat     /v1/chat/completions, K-turn conversations (first user turn ~P words); each turn
           appends the previous answer; turns are sequential, conversations concurrent
Load: `--concurrency C` sessions in flight, or `--rate R` sessions/s with Poisson arrivals
(a session is one request, or one conversation for `chat`).
"""

import argparse
import asyncio
import contextlib
import json
import math
import random
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

import httpx
from tqdm import tqdm

WORDS = ("the of and to in is was for on are with as his they at be this from have or by one had not but what "
         "all were when we there can an your which their said if do will each about how up out them then she "
         "many some so these would other into has more her two like him see time could no make than first been "
         "its who now people my made over did down only way find use may water long little very after words "
         "called just where most know get through back much go good new write our me man too any day same right "
         "look think also around another came come work three word must because does part even place well").split()
ID_RANGE = (1000, 20000)


# --- workloads ---------------------------------------------------------------------------------
def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def make_sessions(a: argparse.Namespace, rng: random.Random) -> List[List[Dict[str, Any]]]:
    """Sessions of request specs: one request each (`prompt` ids or `messages`), or for `chat`
    `turns` user turns whose messages are built at run time from the answers so far."""
    if a.workload == "fixed":
        return [[{"prompt": [rng.randrange(*ID_RANGE) for _ in range(a.prompt_tokens)]}] for _ in range(a.num_requests)]
    if a.workload == "tenants":
        systems = [f"Tenant {t}. " + words(rng, a.prefix_tokens) for t in range(a.tenants)]
        sessions = []
        for i in range(a.num_requests):
            t = rng.randrange(a.tenants)
            user = f"Question {i}: " + words(rng, 8)
            sessions.append([{"tenant": t, "messages": [{"role": "system", "content": systems[t]},
                                                        {"role": "user", "content": user}]}])
        return sessions
    convs = max(1, math.ceil(a.num_requests / a.turns))
    return [[{"user": f"Conversation {c}. " + words(rng, a.prompt_tokens)}]
             + [{"user": f"Turn {k}: " + words(rng, 8)} for k in range(1, a.turns)] for c in range(convs)]


# --- one request -------------------------------------------------------------------------------
async def stream_one(client: httpx.AsyncClient, a: argparse.Namespace, spec: Dict[str, Any], t0: float) -> dict:
    """POST one streamed request; times relative to `t0` (seconds), text of the answer in `_text`."""
    chat = "messages" in spec
    body: Dict[str, Any] = {"max_tokens": a.output_tokens, "ignore_eos": True, "temperature": a.temperature,
                            "stream": True, "stream_options": {"include_usage": True}}
    body.update({"messages": spec["messages"]} if chat else {"prompt": spec["prompt"]})
    if a.model:
        body["model"] = a.model
    rec: Dict[str, Any] = {"start": time.perf_counter() - t0, "ttft": None, "itl": [], "end": None, "status": None,
                           "prompt_tokens": 0, "output_tokens": 0, "cached_tokens": 0, "error": None}
    arrivals: List[float] = []
    text: List[str] = []
    try:
        async with client.stream("POST", "/chat/completions" if chat else "/completions", json=body) as r:
            rec["status"] = r.status_code
            if r.status_code != 200:
                rec["error"] = f"HTTP {r.status_code}: {(await r.aread()).decode(errors='replace')[:300]}"
            else:
                async for line in r.aiter_lines():
                    if not line.startswith("data:") or (data := line[5:].strip()) == "[DONE]":
                        continue
                    now, msg = time.perf_counter() - t0, json.loads(data)
                    if "error" in msg:
                        rec["error"] = str(msg["error"])
                        break
                    if msg.get("usage"):
                        u = msg["usage"]
                        rec["prompt_tokens"] = u.get("prompt_tokens", 0)
                        rec["output_tokens"] = u.get("completion_tokens", 0)
                        rec["cached_tokens"] = (u.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
                    for ch in msg.get("choices") or []:
                        piece = (ch.get("delta") or {}).get("content") if chat else ch.get("text")
                        if piece or arrivals:  # a leading empty chunk is a role header, not a token
                            arrivals.append(now)
                            text.append(piece or "")
    except (httpx.HTTPError, ValueError) as e:
        rec["error"] = f"{type(e).__name__}: {e}"
    rec["end"] = time.perf_counter() - t0
    if rec["error"] is None and not arrivals:
        rec["error"] = "no tokens streamed"
    if arrivals:
        rec["ttft"] = arrivals[0] - rec["start"]
        rec["itl"] = [nxt - prev for prev, nxt in zip(arrivals, arrivals[1:])]
        rec["output_tokens"] = rec["output_tokens"] or len(arrivals)
    rec["_text"] = "".join(text)
    return rec


async def run_session(client, a, sid: int, session, t0: float, out: List[Dict[str, Any]], bar) -> None:
    """Run a session's requests in order (chat turns see the previous answers)."""
    history: List[Dict[str, str]] = []
    for k, spec in enumerate(session):
        if "user" in spec:
            history.append({"role": "user", "content": spec["user"]})
            spec = {"messages": list(history)}
        rec = await stream_one(client, a, spec, t0)
        history.append({"role": "assistant", "content": rec.pop("_text")})
        out.append({"session": sid, "turn": k, **({"tenant": spec["tenant"]} if "tenant" in spec else {}), **rec})
        bar.update(1)
        if rec["error"] and "user" in session[0]:
            bar.update(len(session) - k - 1)  # a failed turn ends its conversation
            return


async def run(a: argparse.Namespace) -> List[Dict[str, Any]]:
    rng = random.Random(a.seed)
    sessions = make_sessions(a, rng)
    headers = {"Authorization": f"Bearer {a.api_key}"} if a.api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=a.concurrency or 64)
    records: List[Dict[str, Any]] = []
    async with httpx.AsyncClient(base_url=a.base_url.rstrip("/"), headers=headers, timeout=a.timeout,
                                 limits=limits) as client:
        if not a.model:  # OpenAI servers want a model name: take the first one served
            with contextlib.suppress(httpx.HTTPError, ValueError, KeyError, IndexError):
                a.model = (await client.get("/models")).json()["data"][0]["id"]
        sem = asyncio.Semaphore(a.concurrency) if a.concurrency else contextlib.nullcontext()
        bar = tqdm(total=sum(map(len, sessions)), desc=f"bench {a.workload}", unit="req", file=sys.stderr)
        t0 = time.perf_counter()

        async def guarded(sid, s):
            async with sem:
                await run_session(client, a, sid, s, t0, records, bar)

        tasks = []
        for sid, s in enumerate(sessions):
            tasks.append(asyncio.create_task(guarded(sid, s)))
            if a.rate:
                await asyncio.sleep(rng.expovariate(a.rate))
        await asyncio.gather(*tasks)
        bar.close()
    return sorted(records, key=lambda r: r["start"])


# --- results -----------------------------------------------------------------------------------
def percentile(xs: List[float], q: float) -> Optional[float]:
    """Linear-interpolated percentile (q in [0, 100]), as numpy's default; None when empty."""
    if not xs:
        return None
    xs = sorted(xs)
    i = (len(xs) - 1) * q / 100
    lo = math.floor(i)
    return xs[lo] + (xs[min(lo + 1, len(xs) - 1)] - xs[lo]) * (i - lo)


def _dist(xs: List[float], qs=(50, 90, 99)) -> Dict[str, Optional[float]]:
    return {"mean": sum(xs) / len(xs) if xs else None, **{f"p{q}": percentile(xs, q) for q in qs}}


def summarize(records: List[Dict[str, Any]]) -> Dict[str, Any]:
    """Counts, duration (first start to last end), rates over it, latency distributions
    (seconds) of the successful requests, and prefix hit rate = cached / prompt tokens."""
    ok = [r for r in records if not r.get("error")]
    duration = (max(r["end"] for r in records) - min(r["start"] for r in records)) if records else 0.0
    prompt, cached = sum(r["prompt_tokens"] for r in ok), sum(r["cached_tokens"] for r in ok)
    output = sum(r["output_tokens"] for r in ok)
    return {"requests": len(records), "ok": len(ok), "failed": len(records) - len(ok), "duration_s": duration,
            "request_throughput": len(ok) / duration if duration else 0.0,
            "output_throughput": output / duration if duration else 0.0,
            "prompt_tokens": prompt, "output_tokens": output, "cached_tokens": cached,
            "prefix_hit_rate": cached / prompt if prompt else 0.0,
            "ttft_s": _dist([r["ttft"] for r in ok]), "itl_s": _dist([x for r in ok for x in r["itl"]]),
            "e2e_s": _dist([r["end"] - r["start"] for r in ok])}


def format_table(s: Dict[str, Any]) -> str:
    def ms(d, qs=(50, 90, 99)):
        return "  ".join(f"p{q} " + (f"{d[f'p{q}'] * 1e3:8.1f}" if d[f"p{q}"] is not None else f"{'n/a':>8}")
                         for q in qs) + "  ms"

    rows = [("requests ok / failed", f"{s['ok']} / {s['failed']}"), ("duration", f"{s['duration_s']:.2f} s"),
            ("request throughput", f"{s['request_throughput']:.2f} req/s"),
            ("output throughput", f"{s['output_throughput']:.1f} tok/s"),
            ("TTFT", ms(s["ttft_s"])), ("ITL", ms(s["itl_s"])), ("e2e latency", ms(s["e2e_s"], (50, 99))),
            ("prefix hit rate",
             f"{s['prefix_hit_rate']:.1%} ({s['cached_tokens']} / {s['prompt_tokens']} prompt tokens)")]
    return "\n".join(f"{k:<22}{v}" for k, v in rows)


def plot(records: List[Dict[str, Any]], path: str) -> None:
    """TTFT histogram, ITL histogram and output tokens/s over time, as one PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in records if not r.get("error")]
    fig, ax = plt.subplots(1, 3, figsize=(15, 4))
    ax[0].hist([r["ttft"] * 1e3 for r in ok], bins=30)
    ax[0].set(title="TTFT", xlabel="ms", ylabel="requests")
    ax[1].hist([x * 1e3 for r in ok for x in r["itl"]], bins=50)
    ax[1].set(title="inter-token latency", xlabel="ms", ylabel="chunks")
    times, weights = [], []  # each chunk carries output_tokens / chunks tokens
    for r in ok:
        t = [r["start"] + r["ttft"]]
        for x in r["itl"]:
            t.append(t[-1] + x)
        times += t
        weights += [r["output_tokens"] / len(t)] * len(t)
    if times:
        width = max((max(times) - min(times)) / 50, 0.1)
        nbins = int(max(times) / width) + 1
        ax[2].hist(times, bins=[i * width for i in range(nbins + 1)], weights=[w / width for w in weights])
    ax[2].set(title="output throughput", xlabel="s since start", ylabel="tokens/s")
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="macfarm-bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    p.add_argument("--api-key")
    p.add_argument("--model", help="default: the first of GET /models")
    p.add_argument("--workload", choices=("fixed", "tenants", "chat"), default="fixed")
    p.add_argument("--num-requests", type=int, default=100)
    load = p.add_mutually_exclusive_group()
    load.add_argument("--concurrency", type=int, help="sessions in flight (default 8)")
    load.add_argument("--rate", type=float, help="sessions per second, Poisson arrivals, no concurrency cap")
    p.add_argument("--prompt-tokens", type=int, default=256, help="fixed: prompt ids; chat: first user turn words")
    p.add_argument("--output-tokens", type=int, default=128)
    p.add_argument("--tenants", type=int, default=4)
    p.add_argument("--prefix-tokens", type=int, default=512, help="tenants: system prompt words")
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--out", help="JSON results (config, summary, records)")
    p.add_argument("--plot", help="PNG plots")
    a = p.parse_args(argv)
    if a.rate is None and a.concurrency is None:
        a.concurrency = 8
    return a


def main(argv=None) -> int:
    a = parse_args(argv)
    records = asyncio.run(run(a))
    s = summarize(records)
    print(format_table(s))
    if s["failed"]:
        print(f"{'first error':<22}{next(r['error'] for r in records if r['error'])}")
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps({"config": vars(a), "summary": s, "records": records}, indent=1))
    if a.plot:
        plot(records, a.plot)
    return 0 if s["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())

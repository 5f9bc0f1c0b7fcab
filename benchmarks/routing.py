"""Routing benchmark: a multi-tenant shared-prefix workload against N replicas.

    python benchmarks/routing.py [--requests 200] [--rate 6] [--tenants 16]
                                 [--prefix-tokens 1000] [--replicas 4]

Compares four routers on the same workload (same seed, same prompts, same arrivals):
- prefix:      this project's PrefixAffinityRouter (`router: prefix`);
- pow2:        Serve's default power-of-two-choices router (`router: pow2`);
- round_robin: a plain round-robin RequestRouter (defined here);
- oracle:      pins tenant t to replica t % N (defined here; it knows the tenant of
               each prompt from the hash of its first page, precomputed below).

Setup: a local Ray cluster simulating a farm (`ray.cluster_utils.Cluster`: a head with
2 CPUs and N one-CPU nodes with the custom resource "mac", so Serve places one replica
per "Mac"); the real macfarm app (Ingress + MLXReplica, the real engine, scheduler and
paged prefix cache) on a TINY random-weight llama (2 layers, hidden 64, the default
model's tokenizer), so that a 1,000-token prefill costs milliseconds and the whole
workload fits on a 2-core machine. Every figure printed here comes from that tiny
model: hit rates and load balance are what the real routers and cache do; absolute
TTFT/throughput measure Serve + engine overhead on this host, not a Mac's speed.
The KV pool (`--kv-tokens`, default 6,000 tokens per replica) holds a replica's fair
share of tenant prefixes plus slack, but not all of them, so affinity matters.

Each request goes through the real HTTP API (streamed, `include_usage`), and records
TTFT (first SSE chunk), latency, prompt/cached tokens (`usage.prompt_tokens_details`)
and completion tokens. Hit rate = sum(cached tokens) / sum(prompt tokens).

Load per replica = requests each replica served. The replica is found per request from
Serve's replica access logs (each replica writes `CALL generate OK` lines tagged with
the request id, which Serve propagates from the client's `x-request-id` header through
the ingress to the replica). Cross-check: each engine's own counters (`stats()`:
prompt tokens queried, prefix hits, evictions), read through a deployment handle.

Prints one table and writes `benchmarks/results/routing.png` (matplotlib, Agg).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

import mlx_worker  # noqa: E402,F401  (OpenBLAS before mlx on Linux)
import httpx  # noqa: E402
import numpy as np  # noqa: E402
from common import pct  # noqa: E402  (benchmarks/common.py)
import ray  # noqa: E402
from ray import serve  # noqa: E402
from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica  # noqa: E402

from mlx_worker.models.gguf import default_model_path  # noqa: E402
from mlx_worker.memory.paging import PAGE_SIZE, page_hashes  # noqa: E402
from serve_app.app import build_app, compose_app  # noqa: E402
from serve_fixtures import free_port, stop_farm, wait_healthy  # noqa: E402  (tests/)

POLICIES = ("prefix", "pow2", "round_robin", "oracle")
APP = "routing-bench"
MODEL_NAME = "tiny"


# --- baseline routers (pickled by value with the deployment: defined in __main__) ------
def _sorted(replicas: List[RunningReplica]) -> List[RunningReplica]:
    return sorted(replicas, key=lambda r: r.replica_id.unique_id)


class _FixedOrderRouter(RequestRouter):
    """Replicas in a fixed order, rotated to start at `first(...)`; the rest are fallbacks."""

    def first(self, n: int, pending_request: Optional[PendingRequest]) -> int:
        raise NotImplementedError

    async def choose_replicas(
        self, candidate_replicas: List[RunningReplica], pending_request: Optional[PendingRequest] = None
    ) -> List[List[RunningReplica]]:
        if pending_request is not None:
            pending_request.routing_context.should_backoff = True
        if not candidate_replicas:
            return []
        reps = _sorted(candidate_replicas)
        i = self.first(len(reps), pending_request)
        return [[r] for r in reps[i:] + reps[:i]]


class RoundRobinRouter(_FixedOrderRouter):
    """Each request to the next replica in a fixed order (the rest as fallbacks)."""

    def initialize_state(self, **kwargs: Any) -> None:
        self._next = 0

    def first(self, n: int, pending_request: Optional[PendingRequest]) -> int:
        i = getattr(self, "_next", 0) % n
        self._next = i + 1
        return i


class TenantOracleRouter(_FixedOrderRouter):
    """Pins tenant t to replica t % N (replicas in a fixed order).

    The tenant of a request is looked up from the hash of its prompt's first page
    (`request["page_hashes"][0]`, computed by the ingress): the benchmark precomputes
    {first-page hash: tenant} and passes it as `tenant_of_hash`. Unknown prompts
    (warm-up, stats calls) go to a random replica.
    """

    def initialize_state(self, tenant_of_hash: Optional[Dict[str, int]] = None, **kwargs: Any) -> None:
        self._tenant_of = {str(k): int(v) for k, v in (tenant_of_hash or {}).items()}

    def first(self, n: int, pending_request: Optional[PendingRequest]) -> int:
        tenant = None
        if pending_request is not None:
            for a in list(pending_request.args) + list(pending_request.kwargs.values()):
                if isinstance(a, dict) and a.get("page_hashes"):
                    tenant = getattr(self, "_tenant_of", {}).get(str(a["page_hashes"][0]))
                    break
        return tenant % n if tenant is not None else random.randrange(n)


# --- workload ----------------------------------------------------------------------------
class Workload:
    """Tenants' system prompts, the request sequence and Poisson arrival times."""

    def __init__(self, tokenizer, tenants: int, prefix_tokens: int, requests: int, rate: float,
                 page_size: int, seed: int = 0):
        rng = random.Random(seed)
        vocab = tokenizer._tokenizer.get_vocab() if hasattr(tokenizer, "_tokenizer") else tokenizer.get_vocab()
        words = sorted({t[1:] for t in vocab if t.startswith("\u0120") and t[1:].isalpha()
                        and t[1:].islower() and t[1:].isascii() and len(t) > 3})
        self.words = words
        self.systems = []
        for t in range(tenants):
            head = f"Tenant {t:02d}. You are the assistant of tenant number {t}. "
            body = " ".join(rng.choice(words) for _ in range(prefix_tokens))
            ids = tokenizer.encode(head + body)[:prefix_tokens]
            self.systems.append(tokenizer.decode(ids))
        self.tenant = [rng.randrange(tenants) for _ in range(requests)]
        self.user = [" ".join(rng.choice(words) for _ in range(rng.randint(10, 30))).capitalize() + "?"
                     for _ in range(requests)]
        gaps = [rng.expovariate(rate) for _ in range(requests)]
        self.arrival = list(np.cumsum(gaps) - gaps[0])
        # The oracle's map: first-page hash of each tenant's prompt -> tenant.
        self.tenant_of_hash: Dict[str, int] = {}
        self.system_tokens = []
        for t, s in enumerate(self.systems):
            ids = tokenizer.apply_chat_template(self.messages_for(s, "Hi?"), add_generation_prompt=True)
            self.system_tokens.append(len(tokenizer.apply_chat_template([{"role": "system", "content": s}])))
            h = page_hashes(ids[:page_size], page_size)
            assert h, "prompt shorter than a page"
            assert str(h[0]) not in self.tenant_of_hash, "two tenants share a first page"
            self.tenant_of_hash[str(h[0])] = t

    @staticmethod
    def messages_for(system: str, user: str) -> List[Dict[str, str]]:
        return [{"role": "system", "content": system}, {"role": "user", "content": user}]

    def messages(self, i: int) -> List[Dict[str, str]]:
        return self.messages_for(self.systems[self.tenant[i]], self.user[i])


# --- cluster and apps --------------------------------------------------------------------
def make_model_dir(tmp: Path) -> str:
    from tiny_models import save_tiny_model

    path = save_tiny_model("llama", tmp / "tiny-llama", tokenizer_dir=default_model_path())
    # tiny_models caps the context at 1,024; a 1,000-token system prompt plus chat
    # template and user turn needs more (RoPE has no learned length limit).
    cfg = json.loads((path / "config.json").read_text())
    cfg["max_position_embeddings"] = 8192
    (path / "config.json").write_text(json.dumps(cfg))
    return str(path)


def start_cluster(replicas: int):
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "include_dashboard": False})
    for _ in range(replicas):
        cluster.add_node(num_cpus=1, resources={"mac": 1})
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False)
    return cluster


def build(policy: str, model_dir: str, engine: Dict[str, Any], replicas: int, wl: Workload) -> serve.Application:
    args = dict(model=model_dir, model_name=MODEL_NAME, num_replicas=replicas, replica_resource="mac",
                engine=engine, router="prefix" if policy == "prefix" else "pow2")
    if policy in ("prefix", "pow2"):
        return build_app(args)
    cls, kwargs = (RoundRobinRouter, {}) if policy == "round_robin" else (
        TenantOracleRouter, {"tenant_of_hash": wl.tenant_of_hash})
    return compose_app(args, {"request_router_class": cls, "request_router_kwargs": kwargs,
                            "request_routing_stats_period_s": 1})


def engine_stats(replicas: int, tries: int = 60) -> Dict[str, Dict[str, Any]]:
    """Each replica's engine counters, by engine_id (a handle reaches one replica per
    call: call until all have answered)."""
    h = serve.get_deployment_handle("MLXReplica", APP).options(method_name="stats")
    seen: Dict[str, Dict[str, Any]] = {}
    for _ in range(tries):
        st = h.remote().result(timeout_s=30)
        seen[st["engine_id"]] = st
        if len(seen) >= replicas:
            break
    return seen


# --- load per replica from Serve's access logs ------------------------------------------
def replica_of_request(session_dir: Path, tag: str) -> Dict[str, str]:
    """{request id: replica id} for the `generate` calls whose request id starts with tag."""
    out: Dict[str, str] = {}
    pat = re.compile(rf"\s({re.escape(tag)}\d+)\s.*\bgenerate\b")
    for f in (session_dir / "logs" / "serve").glob(f"replica_{APP}_MLXReplica_*.log"):
        rep = f.stem.rsplit("_", 1)[-1]
        for line in f.read_text(errors="replace").splitlines():
            m = pat.search(line)
            if m:
                out[m.group(1)] = rep
    return out


# --- the client --------------------------------------------------------------------------
async def one_request(client: httpx.AsyncClient, base: str, messages, rid: str, max_tokens: int) -> Dict[str, Any]:
    body = {"model": MODEL_NAME, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    rec: Dict[str, Any] = {"rid": rid, "t_send": t0, "ok": False}
    try:
        async with client.stream("POST", f"{base}/v1/chat/completions", json=body,
                                 headers={"x-request-id": rid}) as r:
            if r.status_code != 200:
                rec["error"] = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return rec
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                rec.setdefault("ttft", time.perf_counter() - t0)
                data = line[6:]
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if chunk.get("usage"):
                    u = chunk["usage"]
                    rec["prompt"] = u["prompt_tokens"]
                    rec["completion"] = u["completion_tokens"]
                    rec["cached"] = (u.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        rec["latency"] = time.perf_counter() - t0
        rec["t_done"] = time.perf_counter()
        rec["ok"] = "prompt" in rec
    except Exception as e:  # noqa: BLE001 - record and go on
        rec["error"] = repr(e)
    return rec


async def run_workload(base: str, wl: Workload, tag: str, max_tokens: int) -> List[Dict[str, Any]]:
    limits = httpx.Limits(max_connections=2000, max_keepalive_connections=200)
    async with httpx.AsyncClient(timeout=300, limits=limits) as client:
        t0 = time.perf_counter()

        async def at(i: int):
            await asyncio.sleep(max(0.0, t0 + wl.arrival[i] - time.perf_counter()))
            rec = await one_request(client, base, wl.messages(i), f"{tag}{i}", max_tokens)
            rec["tenant"] = wl.tenant[i]
            return rec

        return await asyncio.gather(*[at(i) for i in range(len(wl.tenant))])


async def warm_up(base: str, wl: Workload, n: int) -> None:
    """Short prompts no tenant shares, to get every process past its first call."""
    rng = random.Random(1)
    async with httpx.AsyncClient(timeout=120) as client:
        for _ in range(2):
            msgs = [[{"role": "user", "content": " ".join(rng.choice(wl.words) for _ in range(40))}]
                    for _ in range(n)]
            await asyncio.gather(*[
                client.post(f"{base}/v1/chat/completions", json={"model": MODEL_NAME, "messages": m,
                                                                  "max_tokens": 4, "ignore_eos": True})
                for m in msgs])


# --- one policy --------------------------------------------------------------------------
def run_policy(policy: str, base: str, model_dir: str, engine: Dict[str, Any], wl: Workload,
               args, session_dir: Path) -> Dict[str, Any]:
    t_start = time.time()
    serve.run(build(policy, model_dir, engine, args.replicas, wl), name=APP, route_prefix="/", blocking=False)
    wait_healthy(base, timeout=180)
    asyncio.run(warm_up(base, wl, 2 * args.replicas))
    before = engine_stats(args.replicas)
    t_ready = time.time()
    tag = f"rb-{policy}-{int(time.time())}-"
    recs = asyncio.run(run_workload(base, wl, tag, args.max_tokens))
    t_run = time.time() - t_ready
    after = engine_stats(args.replicas)
    time.sleep(1.0)  # let the replicas' log handlers flush
    where = replica_of_request(session_dir, tag)
    serve.delete(APP)
    res = summarize(policy, recs, where, before, after, args.replicas)
    res["timing"] = {"deploy_s": t_ready - t_start, "run_s": t_run, "total_s": time.time() - t_start}
    return res


def summarize(policy, recs, where, before, after, replicas) -> Dict[str, Any]:
    ok = [r for r in recs if r["ok"]]
    errors = [r.get("error") for r in recs if not r["ok"]]
    prompt = sum(r["prompt"] for r in ok)
    cached = sum(r["cached"] for r in ok)
    ttft = np.array([r["ttft"] for r in ok]) * 1000
    lat = np.array([r["latency"] for r in ok]) * 1000
    span = max(r["t_done"] for r in ok) - min(r["t_send"] for r in recs) if ok else float("nan")
    # Load per replica: requests served (access logs), in a fixed replica order.
    reps = sorted(set(where.values()))
    counts = {rep: 0 for rep in reps}
    prefill = {rep: 0 for rep in reps}  # uncached prompt tokens computed there
    for r in ok:
        rep = where.get(r["rid"])
        if rep is not None:
            counts[rep] += 1
            prefill[rep] += r["prompt"] - r["cached"]
    load = list(counts.values()) + [0] * max(0, replicas - len(counts))  # an idle replica logs nothing
    # Cross-check from the engines' own counters (delta over the measured run).
    eng = []
    for eid, st in after.items():
        b = before.get(eid, {})
        d = {k: st[k] - b.get(k, 0) for k in ("prefix_query_tokens", "prefix_hit_tokens", "evictions",
                                                "preemptions")}
        eng.append({"engine_id": eid, **d})
    q = [e["prefix_query_tokens"] for e in eng]
    return {
        "policy": policy,
        "n": len(recs), "ok": len(ok), "errors": errors[:3], "num_errors": len(errors),
        "hit_rate": cached / prompt if prompt else float("nan"),
        "ttft_p50": pct(ttft, 0.5), "ttft_p99": pct(ttft, 0.99), "lat_p50": pct(lat, 0.5),
        "req_s": len(ok) / span, "tok_s": sum(r["completion"] for r in ok) / span,
        "prompt_tok_s": prompt / span,
        "load": load, "load_logged": sum(load),
        "load_ratio": max(load) / (sum(load) / len(load)) if sum(load) else float("nan"),
        "prefill": list(prefill.values()),
        "engine": eng,
        "engine_load_ratio": max(q) / (sum(q) / len(q)) if q and sum(q) else float("nan"),
        "engine_hit_rate": sum(e["prefix_hit_tokens"] for e in eng) / max(1, sum(q)),
        "evictions": sum(e["evictions"] for e in eng),
        "preemptions": sum(e["preemptions"] for e in eng),
    }


# --- output ------------------------------------------------------------------------------
def report(results: Dict[str, Dict[str, Any]], args, wall_s: float) -> None:
    oracle = results.get("oracle", {}).get("hit_rate")
    rr = results.get("round_robin", {}).get("hit_rate")
    print()
    print(f"Routing benchmark: {args.tenants} tenants x {args.prefix_tokens}-token system prompt, "
          f"10-30-word user turns, max_tokens {args.max_tokens}, {args.requests} requests/policy, "
          f"Poisson {args.rate} req/s, {args.replicas} replicas, KV pool {args.kv_tokens} tokens/replica.")
    print("ALL FIGURES: tiny random-weight llama (2 layers, hidden 64) on the real macfarm engine "
          "(scheduler, paged prefix cache), real Serve app + HTTP API and the real routers; "
          f"{args.replicas} simulated Macs (ray.cluster_utils) on one {os.cpu_count()}-core host. "
          "Hit rate and load are the routers'; TTFT/throughput are this host's overheads, not a Mac's.")
    hdr = (f"{'policy':<12} {'ok':>7} {'hit rate':>8} {'/oracle':>7} {'/rr':>6} {'TTFT p50':>9} {'TTFT p99':>9} "
           f"{'req/s':>6} {'out tok/s':>9} {'max/mean':>8}  {'requests per replica':<22} {'evict':>6}")
    print(hdr)
    print("-" * len(hdr))
    for p in POLICIES:
        r = results.get(p)
        if r is None:
            continue
        vs_o = f"{r['hit_rate'] / oracle:.2f}x" if oracle else "-"
        vs_rr = f"{r['hit_rate'] / rr:.2f}x" if rr else "-"
        print(f"{p:<12} {r['ok']:>3}/{r['n']:<3} {r['hit_rate']:>8.3f} {vs_o:>7} {vs_rr:>6} "
              f"{r['ttft_p50']:>7.1f}ms {r['ttft_p99']:>7.1f}ms {r['req_s']:>6.2f} {r['tok_s']:>9.1f} "
              f"{r['load_ratio']:>8.2f}  {str(r['load']):<22} {r['evictions']:>6}")
    print()
    print("hit rate = sum(usage cached_tokens) / sum(prompt_tokens) over the requests; "
          "/oracle, /rr: ratio to the oracle's and round-robin's hit rates.")
    print("max/mean = max over replicas / mean of requests served (from Serve's replica access logs, "
          "per request id); evict = KV pages evicted (engine counters).")
    print("cross-check from the engines' counters (prompt tokens queried per replica, max/mean; hit rate;"
          " a request waiting for KV pages is queried again, so these overcount under saturation):")
    for p in POLICIES:
        r = results.get(p)
        if r is None:
            continue
        q = sorted((e["prefix_query_tokens"] for e in r["engine"]), reverse=True)
        print(f"  {p:<12} prompt tokens per replica {q}  max/mean {r['engine_load_ratio']:.2f}  "
              f"engine hit rate {r['engine_hit_rate']:.3f}  preemptions {r['preemptions']}  "
              f"logged {r['load_logged']}/{r['ok']} requests")
        if r["num_errors"]:
            print(f"    {r['num_errors']} errors, e.g. {r['errors']}")
    print()
    if "prefix" in results:
        r = results["prefix"]
        checks = []
        if oracle:
            checks.append(f"hit >= 0.9x oracle: {r['hit_rate'] / oracle:.2f}x "
                          f"{'PASS' if r['hit_rate'] >= 0.9 * oracle else 'FAIL'}")
        if rr:
            checks.append(f"hit >= 2x round-robin: {r['hit_rate'] / rr:.2f}x "
                          f"{'PASS' if r['hit_rate'] >= 2 * rr else 'FAIL'}")
        checks.append(f"max load <= 1.3x mean: {r['load_ratio']:.2f}x {'PASS' if r['load_ratio'] <= 1.3 else 'FAIL'}")
        print("targets (prefix router): " + "; ".join(checks))
    print("timings: " + ", ".join(f"{p} {r['timing']['deploy_s']:.0f}s deploy + {r['timing']['run_s']:.0f}s run"
                                  for p, r in results.items()) + f"; wall {wall_s:.0f}s")


def plot(results: Dict[str, Dict[str, Any]], args, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pols = [p for p in POLICIES if p in results]
    x = np.arange(len(pols))
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.8))
    ax = axes[0]
    bars = ax.bar(x, [results[p]["hit_rate"] for p in pols], color="tab:blue")
    ax.bar_label(bars, fmt="%.2f")
    ax.set_xticks(x, pols)
    ax.set_ylim(0, 1.05)
    ax.set_title("prefix hit rate (cached / prompt tokens)")
    ax = axes[1]
    w = 0.38
    b1 = ax.bar(x - w / 2, [results[p]["ttft_p50"] for p in pols], w, label="p50")
    b2 = ax.bar(x + w / 2, [results[p]["ttft_p99"] for p in pols], w, label="p99")
    ax.bar_label(b1, fmt="%.0f", fontsize=8)
    ax.bar_label(b2, fmt="%.0f", fontsize=8)
    ax.set_xticks(x, pols)
    ax.set_ylabel("ms")
    ax.set_title("TTFT")
    ax.legend()
    ax = axes[2]
    w = 0.8 / args.replicas
    for j in range(args.replicas):
        vals = [sorted(results[p]["load"], reverse=True)[j] if j < len(results[p]["load"]) else 0 for p in pols]
        ax.bar(x - 0.4 + w * (j + 0.5), vals, w, label=f"replica #{j + 1} (by load)")
    for i, p in enumerate(pols):
        ax.text(i, max(results[p]["load"] or [0]) * 1.02, f"max/mean {results[p]['load_ratio']:.2f}",
                ha="center", fontsize=8)
    ax.set_xticks(x, pols)
    ax.set_ylabel("requests served")
    ax.set_title("load per replica (sorted)")
    top = max(max(results[p]["load"] or [1]) for p in pols)
    ax.set_ylim(0, top * 1.3)
    ax.legend(fontsize=7, ncol=2, loc="upper center")
    fig.suptitle(f"{args.tenants} tenants x {args.prefix_tokens}-token prefix, {args.requests} req @ "
                 f"{args.rate}/s Poisson, {args.replicas} replicas, KV {args.kv_tokens} tok/replica - "
                 "tiny random-weight llama on the real engine/prefix cache/Serve/routers", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=200, help="requests per policy")
    ap.add_argument("--rate", type=float, default=6.0, help="Poisson arrival rate, requests/s")
    ap.add_argument("--tenants", type=int, default=16)
    ap.add_argument("--prefix-tokens", type=int, default=1000, help="system prompt tokens per tenant")
    ap.add_argument("--replicas", type=int, default=4)
    ap.add_argument("--kv-tokens", type=int, default=6000, help="KV pool per replica (engine max_total_tokens)")
    ap.add_argument("--max-tokens", type=int, default=8, help="output tokens per request")
    ap.add_argument("--policies", nargs="+", default=list(POLICIES), choices=POLICIES)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--plot", default=str(ROOT / "benchmarks" / "results" / "routing.png"))
    args = ap.parse_args()

    from mlx_lm.utils import load_tokenizer

    wall0 = time.time()
    engine = {"max_total_tokens": args.kv_tokens}
    with tempfile.TemporaryDirectory(prefix="routing-bench-") as tmp:
        model_dir = make_model_dir(Path(tmp))
        tok = load_tokenizer(Path(model_dir))
        wl = Workload(tok, args.tenants, args.prefix_tokens, args.requests, args.rate, PAGE_SIZE, args.seed)
        print(f"workload: system prompts {min(wl.system_tokens)}-{max(wl.system_tokens)} tokens "
              f"(with template), {len(wl.tenant)} requests over {wl.arrival[-1]:.0f}s", flush=True)
        cluster = start_cluster(args.replicas)
        results: Dict[str, Dict[str, Any]] = {}
        try:
            session_dir = Path(ray._private.worker._global_node.get_session_dir_path())
            port = free_port()
            serve.start(http_options={"host": "127.0.0.1", "port": port})
            base = f"http://127.0.0.1:{port}"
            for p in args.policies:
                results[p] = run_policy(p, base, model_dir, engine, wl, args, session_dir)
                r = results[p]
                print(f"  {p}: hit {r['hit_rate']:.3f}, TTFT p50 {r['ttft_p50']:.0f} ms, load {r['load']}, "
                      f"{r['ok']}/{r['n']} ok, {r['timing']['total_s']:.0f}s", flush=True)
        finally:
            stop_farm(cluster)
    report(results, args, time.time() - wall0)
    plot(results, args, Path(args.plot))
    print(f"plot: {args.plot}")


if __name__ == "__main__":
    main()

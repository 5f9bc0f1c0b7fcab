"""The replica deployment: one MLX engine per Mac, streaming outputs to the ingress."""

import asyncio
import logging
import time
import uuid
from typing import Any, AsyncIterator, Dict, Optional

from ray import serve
from ray.serve.metrics import Counter, Gauge, Histogram

from mlx_worker import Engine, EngineConfig, Request, SamplingParams
from mlx_worker.memory.paging import adapter_root
from mlx_worker.vision.image_inputs import ImageInputs

from .rank_group import RankGroup

logger = logging.getLogger("ray.serve")

REPORT_ALL_PAGES = 4096

# Histogram buckets (seconds).
TTFT_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.5, 5.0, 10.0, 20.0, 40.0]
ITL_BUCKETS = [0.002, 0.005, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5]
E2E_BUCKETS = [0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0, 600.0]


class ReplicaMetrics:
    """The replica's Prometheus metrics (Ray exports them with a `ray_` prefix, tagged
    with Serve's application, deployment and replica). Per token: one histogram observe
    and one counter add per streamed delta (a few microseconds); per request: a few
    more; gauges are refreshed from `engine.stats()` when Serve polls the replica."""

    def __init__(self):
        self.ttft = Histogram("macfarm_time_to_first_token_seconds", boundaries=TTFT_BUCKETS,
                              description="Time from the request's arrival at the replica to its first output token.")
        self.itl = Histogram("macfarm_inter_token_latency_seconds", boundaries=ITL_BUCKETS,
                             description="Gap between a sample's streamed deltas, divided by the delta's token count.")
        self.e2e = Histogram("macfarm_request_latency_seconds", boundaries=E2E_BUCKETS,
                             description="Time from the request's arrival at the replica to its end.")
        self.prompt_tokens = Counter("macfarm_prompt_tokens",
                                     description="Prompt tokens of ended requests (once per request, whatever n).")
        self.cached_tokens = Counter("macfarm_cached_prompt_tokens",
                                     description="Prompt tokens served from the prefix cache.")
        self.output_tokens = Counter("macfarm_output_tokens", description="Generated tokens (all samples).")
        self.requests = Counter("macfarm_requests", tag_keys=("finish_reason",),
                                description="Requests that ended, by finish reason (stop, length, abort, error).")
        self.preemptions = Counter("macfarm_preemptions", description="Requests preempted (recomputed) for KV pages.")
        self.evictions = Counter("macfarm_prefix_cache_evictions", description="Cached pages evicted (LRU).")
        self.staged = Counter("macfarm_decode_steps_staged",
                              description="Decode steps that read the batch's KV from its dense staged copy.")
        self.gathered = Counter("macfarm_decode_steps_gathered",
                                description="Decode steps that gathered the batch's KV from the pool (staging over its cap).")
        self.restaged = Counter("macfarm_decode_steps_restaged",
                                description="Staged decode steps that first copied the whole batch in (new arrays for a batch that outgrew them).")
        self.refused = Counter("macfarm_requests_refused_overloaded",
                               description="Requests refused (429) because they could not finish within their timeout (admission.py).")
        self.computed = Counter("macfarm_tokens_computed", description="Prompt and output tokens run through the model.")
        self.wasted = Counter("macfarm_tokens_wasted",
                              description="Of those, tokens computed for requests then aborted (client gone) or failed.")
        self.late = Counter("macfarm_requests_late", tag_keys=("phase",),
                            description="Requests taken that ended past their clients' deadlines, by where they "
                                        "stood then (queued, prefill, decode): work the client gave up on.")
        self._late_seen: Dict[str, int] = {}
        self.step_p50 = Gauge("macfarm_step_seconds_p50", description="Median step time over the last 256 steps.")
        self.step_p99 = Gauge("macfarm_step_seconds_p99", description="99th percentile step time over the last 256 steps.")
        self.chunk = Gauge("macfarm_prefill_tokens_per_step_p50",
                           description="Median prompt tokens of the steps that prefill, over the last 256 steps.")
        self.gap_target = Gauge("macfarm_token_gap_target_seconds",
                                description="The step time a step with decode rows was last sized to (step_budget.py).")
        self.queue_wait = Gauge("macfarm_queue_wait_seconds",
                                description="The queued prompt tokens at the measured prefill rate (admission.py).")
        self.host_ms = Gauge("macfarm_host_ms_per_step",
                             description="Engine-thread work per step that is not device dispatch or wait, ms (since start).")
        self.host_cpu_ms = Gauge("macfarm_host_cpu_ms_per_step",
                                 description="The same work in the engine thread's CPU time (no waits for a core), ms.")
        self.running = Gauge("macfarm_running_requests", description="Requests in the engine's running batch.")
        self.waiting = Gauge("macfarm_waiting_requests", description="Requests waiting for admission.")
        self.kv_used = Gauge("macfarm_kv_pages_used_fraction", description="Fraction of KV pool pages in use.")
        self.load_s = Gauge("macfarm_model_load_seconds",
                            description="How long this replica took to load its model and build its engine.")
        self.hit_rate = Gauge("macfarm_prefix_cache_hit_rate",
                              description="Prompt tokens found in the prefix cache / prompt tokens looked up, since start.")
        self.drafted = Counter("macfarm_speculative_draft_tokens", tag_keys=("method",),
                               description="Draft tokens verified (speculative decoding), by drafting method.")
        self.accepted = Counter("macfarm_speculative_accepted_tokens", tag_keys=("method",),
                                description="Of those, tokens accepted (each one a decode step saved).")
        self._seen = {"preemptions": 0, "evictions": 0, "decode_steps_staged": 0, "decode_steps_gathered": 0,
                      "decode_steps_restaged": 0, "refused_overloaded": 0, "tokens_computed": 0, "tokens_wasted": 0,
                      "drafted_tokens": 0, "accepted_tokens": 0}

    def update(self, st: Dict[str, Any]) -> None:
        """Gauges (and counters of cumulative engine totals) from `engine.stats()`."""
        self.running.set(st["running"])
        self.waiting.set(st["waiting"])
        self.kv_used.set(st["kv_pages_used"] / max(1, st["kv_pages_total"]))
        self.hit_rate.set(st["prefix_hit_tokens"] / max(1, st["prefix_query_tokens"]))
        self.host_ms.set(st["host_ms_per_step"])
        self.host_cpu_ms.set(st["host_cpu_ms_per_step"])
        self.queue_wait.set(st["queue_wait_s"] or 0.0)
        for gauge, key in ((self.step_p50, "step_s_p50"), (self.step_p99, "step_s_p99"),
                           (self.chunk, "prefill_tokens_per_step_p50"), (self.gap_target, "token_gap_target_s")):
            if st[key] is not None:
                gauge.set(st[key])
        for key, counter in (("preemptions", self.preemptions), ("evictions", self.evictions),
                             ("decode_steps_staged", self.staged), ("decode_steps_gathered", self.gathered),
                             ("decode_steps_restaged", self.restaged), ("refused_overloaded", self.refused),
                             ("tokens_computed", self.computed), ("tokens_wasted", self.wasted)):
            delta = st[key] - self._seen[key]
            if delta > 0:
                counter.inc(delta)
                self._seen[key] = st[key]
        spec = st.get("speculative")
        for key, counter in (("drafted_tokens", self.drafted), ("accepted_tokens", self.accepted)):
            delta = (spec[key] if spec else 0) - self._seen[key]
            if delta > 0:
                counter.inc(delta, tags={"method": spec["method"]})
                self._seen[key] = spec[key]
        for phase, n in st["late"].items():
            if n > self._late_seen.get(phase, 0):
                self.late.inc(n - self._late_seen.get(phase, 0), tags={"phase": phase})
                self._late_seen[phase] = n


class EngineReplica:
    """Owns one `mlx_worker.Engine`; `generate` streams its outputs.

    The engine loop runs on its own thread, so this actor's event loop stays free to
    accept requests, stream and answer health checks. Cancelling the stream (client
    gone) aborts the request in the engine and frees its KV pages.
    """

    def __init__(self, engine_config: Dict[str, Any]):
        config = EngineConfig(**engine_config)
        loading = time.perf_counter()
        self.group = None
        if config.tensor_parallel_size * config.pipeline_parallel_size > 1:  # rank 0 of a group of Macs
            self.group = RankGroup(config)
            self.engine = self.group.engine(config)
        else:
            self.engine = Engine(config)
        self.engine_id = uuid.uuid4().hex[:12]  # changes when the replica restarts
        self.metrics = ReplicaMetrics()
        self.load_s = time.perf_counter() - loading
        self.metrics.load_s.set(self.load_s)
        self.evict_asked = False  # the ingress asked it to give its Mac to another model (models/residency.py)
        logger.info(f"model {config.model or 'default'} loaded in {self.load_s:.1f} s")

    async def generate(self, request: Dict[str, Any]) -> AsyncIterator[Any]:
        """request: {"rid", "prompt_ids", "params": SamplingParams dict, "page_hashes",
        "timeout_s"}. Yields RequestOutputs; an error before any output is a dict
        ({"error", "status", ...}: a refusal names this engine and when to retry)."""
        start = time.perf_counter()
        self.evict_asked = False  # in use again
        req = Request(rid=request["rid"], prompt_ids=request["prompt_ids"],
                      params=SamplingParams(**request["params"]), timeout_s=request.get("timeout_s"),
                      adapter=request.get("adapter"),
                      images=ImageInputs(**request["images"]) if request.get("images") else None)
        m = self.metrics
        last: Dict[int, float] = {}  # sample index -> when its previous delta came
        first = last_out = None
        reason = "abort"  # unless the stream ends (closed early: client gone)
        try:
            async for out in self.engine.generate(req):
                k = len(out.token_ids)
                if k:
                    now = time.perf_counter()
                    prev = last.get(out.index)
                    if first is None:
                        first = now
                        m.ttft.observe(now - start)
                    elif prev is not None:
                        m.itl.observe((now - prev) / k)
                    last[out.index] = now
                    m.output_tokens.inc(k)
                if out.index == 0:
                    last_out = out
                if first is None and out.finished and out.error_code == "overloaded":
                    reason = "refused"
                    yield self._refusal(out)
                    return
                yield out
            reason = (last_out.finish_reason if last_out is not None else None) or "stop"
        except ValueError as e:  # bad params the ingress could not check (e.g. vocab ids)
            reason = "error"
            yield {"error": str(e), "status": 400}
        except Exception:
            reason = "error"
            raise
        finally:
            self._request_done(m, start, last_out, reason)

    async def embed(self, request: Dict[str, Any]) -> Dict[str, Any]:
        """request: {"rid", "inputs": [token ids], "pooling", "timeout_s"}. All inputs of
        one embeddings call in one replica call, computed together: {"vectors": [...]},
        or an error dict as `generate` yields."""
        params = SamplingParams(max_tokens=0, embedding=request["pooling"])

        async def one(i, ids):
            last = None
            async for out in self.engine.generate(Request(rid=f"{request['rid']}-{i}", prompt_ids=ids, params=params,
                                                          timeout_s=request.get("timeout_s"),
                                                          adapter=request.get("adapter"))):
                last = out
            return last

        try:
            outs = await asyncio.gather(*[one(i, ids) for i, ids in enumerate(request["inputs"])])
        except ValueError as e:
            return {"error": str(e), "status": 400}
        failed = [o for o in outs if o.finish_reason == "error"]
        refused = [o for o in failed if o.error_code == "overloaded"]
        if refused:
            return self._refusal(max(refused, key=lambda o: o.retry_after_s or 0))
        if failed:
            status = 400 if failed[0].error_code == "context_length_exceeded" else 500
            return {"error": failed[0].error, "status": status, "code": failed[0].error_code}
        return {"vectors": [o.embedding for o in outs]}

    def _refusal(self, out) -> Dict[str, Any]:
        """A request the engine refused as overloaded: which engine, and when to retry."""
        return {"error": out.error, "status": 429, "code": "overloaded", "retry_after_s": out.retry_after_s,
                "engine_id": self.engine_id}

    @staticmethod
    def _request_done(m: ReplicaMetrics, start: float, out, reason: str) -> None:
        try:
            m.requests.inc(tags={"finish_reason": reason})
            if reason == "refused":  # no work, and answered at once: not a latency of served requests
                return
            m.e2e.observe(time.perf_counter() - start)
            if out is not None and out.num_prompt_tokens:
                m.prompt_tokens.inc(out.num_prompt_tokens)
                if out.num_cached_tokens:
                    m.cached_tokens.inc(out.num_cached_tokens)
        except Exception:  # noqa: BLE001 - metrics must never break a stream
            pass

    def evict(self) -> None:
        """Unload when idle: the autoscaling policy (models/residency.py) then scales this
        model down; a request arriving first keeps it."""
        self.evict_asked = True

    def record_autoscaling_stats(self) -> Dict[str, float]:
        """Serve's custom autoscaling metrics: `evict` 1 while asked to unload and idle."""
        st = self.engine.stats()
        return {"evict": float(self.evict_asked and not (st["running"] or st["waiting"]))}

    def resident_adapters(self) -> list:
        adapters = self.engine.stats().get("adapters")
        return adapters["resident"] if adapters else []

    def stats(self) -> Dict[str, Any]:
        st = self.engine.stats()
        st.pop("cached_page_hashes")
        st.pop("disk_page_hashes")
        return {"engine_id": self.engine_id, **st}

    def record_routing_stats(self) -> Dict[str, Any]:
        """Load and cached pages, for the prefix-affinity router (Serve calls this every
        request_routing_stats_period_s; it also refreshes the metric gauges).

        The pages the SSD tier holds go with them (a second tier). Past
        REPORT_ALL_PAGES hashes only a quarter of each is sent (`sampled`).
        """
        st = self.engine.stats()
        try:
            self.metrics.update(st)
        except Exception:  # noqa: BLE001 - metrics must never break routing stats
            pass
        hashes = sampled(st["cached_page_hashes"])
        if st.get("adapters"):  # the roots of the resident adapters' hash chains (models/served_model.py)
            hashes = [*hashes, *(adapter_root(a) for a in st["adapters"]["resident"])]
        return {
            "engine_id": self.engine_id,
            "page_size": st["page_size"],
            "running": st["running"],
            "waiting": st["waiting"],
            "kv_used": st["kv_pages_used"] / max(1, st["kv_pages_total"]),
            "queue_wait_s": st["queue_wait_s"] or 0.0,
            "cached_page_hashes": hashes,
            "disk_page_hashes": sampled(st["disk_page_hashes"] or []),
        }

    async def check_health(self) -> None:
        if self.engine.error is not None:
            raise RuntimeError(f"engine loop died: {self.engine.error!r}")
        if self.group is not None:  # a follower gone: Serve restarts the whole group
            await self.group.check()

    def __del__(self):
        engine: Optional[Engine] = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()


def sampled(hashes: list) -> list:
    """Past REPORT_ALL_PAGES hashes a deterministic quarter (about 40 KiB per 4k pages
    otherwise, every second): each hash names its whole prefix, so the router still finds
    the deepest page of a prompt within 3 pages."""
    return [h for h in hashes if h % 4 == 0] if len(hashes) > REPORT_ALL_PAGES else hashes


MLXReplica = serve.deployment(EngineReplica, name="MLXReplica")

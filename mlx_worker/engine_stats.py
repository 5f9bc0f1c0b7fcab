"""What `Engine.stats()` reports: load, KV use, cache counters, the cached page hashes
(the router's signal), step times and the step budget's figures.

The engine thread publishes a snapshot after each step; callers read it without ever
waiting on the device.
"""

import time
from collections import deque

import mlx.core as mx
import numpy as np

STEP_WINDOW = 256  # recent steps behind the step-time figures
HASHES_PERIOD_S = 0.25  # cached page hashes are re-listed at most this often while busy


class EngineStats:
    def __init__(self, memory: dict):
        self.memory = memory  # the budgets peak memory should stay within
        self.recent_steps: deque = deque(maxlen=STEP_WINDOW)  # (seconds, decode rows, prefill tokens)
        self.snapshot: dict = {}
        self._hashes_version, self._hashes_at = -1, 0.0
        self._disk_at = -HASHES_PERIOD_S

    def step(self, seconds: float, decode_rows: int, prefill_tokens: int) -> None:
        self.recent_steps.append((seconds, decode_rows, prefill_tokens))

    def current(self, engine) -> dict:
        # The SSD tier's counters as they are now: its writer files pages after the last
        # step too (an idle engine publishes nothing).
        disk = {"prefix_cache_disk": engine.disk.stats() if engine.disk else None}
        return {**self.snapshot, **self.step_figures(engine), **disk}

    def publish(self, engine) -> None:
        """Take the engine's figures after a step (or a failure), on the engine thread."""
        pm, sched, worker = engine.pages, engine.scheduler, engine.worker
        now = time.monotonic()
        hashes = self.snapshot.get("cached_page_hashes", [])
        snaps = engine.snapshots
        version = (pm.version, snaps.version if snaps else 0)
        if self._hashes_version != version and (now - self._hashes_at >= HASHES_PERIOD_S or not sched.has_work()):
            # A model with recurrent layers resumes only at a snapshot: report those pages.
            hashes = snaps.hashes(pm.page_of) if snaps else pm.cached_hashes()
            self._hashes_version, self._hashes_at = version, now
        disk = self.snapshot.get("disk_page_hashes")
        if engine.disk is not None and (now - self._disk_at >= HASHES_PERIOD_S or not sched.has_work()):
            disk, self._disk_at = engine.disk.hashes(), now
        steps = max(1, engine.num_steps)
        self.snapshot = {
            "running": len(sched.running),
            "waiting": len(sched.waiting),
            "kv_pages_used": pm.used(),
            "kv_pages_total": pm.num_pages,
            "kv_pages_cached": len(pm.page_of),
            "page_size": pm.page_size,
            "kv_bits": getattr(engine.pool, "quantization", (None,))[0],
            "prefix_hit_tokens": pm.hit_tokens,
            "prefix_query_tokens": pm.query_tokens,
            "evictions": pm.evictions,
            "preemptions": sched.num_preemptions,
            "steps": engine.num_steps,
            "failed_steps": engine.num_failed_steps,
            "decode_steps_staged": worker.kv.staging.num_staged,
            "decode_steps_gathered": worker.kv.staging.num_gathered,
            "decode_steps_restaged": worker.kv.staging.num_restaged,  # of the staged: new arrays, all rows copied in
            "queued_prefill_tokens": (queued := sched.queued_prefill_tokens()),
            "queue_wait_s": engine.admission.wait_s(queued),  # the queued prefill at the measured rate; None: not yet
            "refused_overloaded": engine.admission.num_refused + engine.admission.num_refused_early
            + engine.admission.num_withdrawn,
            "withdrawn_overloaded": engine.admission.num_withdrawn,
            "tokens_computed": sched.tokens_computed,
            "tokens_wasted": sched.tokens_wasted,  # computed for requests then aborted (client gone) or failed
            "late": {phase: sched.late[phase] for phase in ("queued", "prefill", "decode")},  # ended past deadline
            "host_ms_per_step": 1e3 * engine._host_s / steps,
            "graph_build_ms_per_step": 1e3 * worker.build_s / steps,  # of host_ms: the model's own code
            "host_cpu_ms_per_step": 1e3 * engine._host_cpu_s / steps,  # host_ms in CPU time: no waits for a core
            "graph_build_cpu_ms_per_step": 1e3 * worker.build_cpu_s / steps,
            "device_ms_per_step": 1e3 * worker.device_s / steps,
            "cached_page_hashes": hashes,
            "disk_page_hashes": disk,  # the SSD tier's (router: a second tier)
            "ranks": engine.ranks.size if engine.ranks else 1,  # Macs this engine spans
            "batching": engine.batching,
            "recurrent_state_bytes_per_request": engine.state_bytes_per_request,
            "state_snapshots": len(snaps) if snaps else 0,
            "state_snapshot_bytes": snaps.nbytes if snaps else 0,
            "peak_memory_bytes": mx.get_peak_memory(),
            "adapters": engine.adapters.stats() if engine.adapters else None,  # resident LoRA adapters
            "speculative": engine.speculator.stats() if engine.speculator else None,  # drafts verified, accepted
            "images": engine.model.stats() if engine.worker.vision else None,  # the image cache
            **self.memory,
        }

    def step_figures(self, engine) -> dict:
        """Step times and prefill per step over the last STEP_WINDOW steps, the token gap
        the budget aims at, and the fitted step cost."""
        steps = list(self.recent_steps)
        times = [t for t, _, _ in steps]
        mixed = [t for t, rows, tokens in steps if rows and tokens]
        chunks = [tokens for _, _, tokens in steps if tokens]
        q = lambda xs, p: float(np.quantile(xs, p)) if xs else None  # noqa: E731
        accuracy = list(engine.admission.accuracy)
        return {"completion_over_prediction_p50": q(accuracy, 0.5), "completion_over_prediction_p90": q(accuracy, 0.9),
                "prediction_calibration": engine.admission.calibration,
                "step_s_p50": q(times, 0.5), "step_s_p99": q(times, 0.99),
                "mixed_step_s_p50": q(mixed, 0.5), "mixed_step_s_p99": q(mixed, 0.99),
                "prefill_tokens_per_step_p50": q(chunks, 0.5), "prefill_tokens_per_step_max": max(chunks, default=None),
                "token_gap_target_s": engine.budget.last_gap_s,
                "decode_only_steps_for_deadlines": engine.budget.num_urgent_steps, "token_gap_s": engine.admission.gap_s,
                "step_cost": engine.budget.cost.describe()}

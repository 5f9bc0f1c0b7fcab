"""When models load and unload: through Serve's own autoscaling.

A model with `min_replicas` below its replica count gets a Serve autoscaling config with
the policy below: its first request scales it up from zero (Serve's cold-start path: the
request waits in the handle until a replica is up), requests in flight keep it (Serve
counts them), and it scales back to `min_replicas` after `idle_unload_s` without any.
When a model's replicas cannot be placed (no Mac has the memory left: placement.py),
the ingress (`Residency`) asks the least recently used idle model that may unload to
give its Macs back; its replica reports that through a custom autoscaling metric, and
the policy scales it down at once. A model or replica with requests in flight is never
unloaded: the policy only ever drops replicas of a model with none.
"""

import asyncio
import logging
import math
import time
from typing import Dict, Optional

from ray.serve.metrics import Counter, Gauge

logger = logging.getLogger("ray.serve")

POLL_S = 1.0  # how often the ingress reads Serve's replica states
STARVED_S = 3.0  # a model with requests and no replica up this long gets room made for it
EVICT_AGAIN_S = 30.0  # an eviction asked of a model is not asked again sooner
LOOK_BACK_S = 12.0  # Serve's window over requests and metrics for these models (above its 10 s metrics interval)


class IdleUnload:
    """Serve autoscaling policy of a model that loads on demand (class-based: Serve makes
    one per deployment with `policy_kwargs`)."""

    def __init__(self, idle_unload_s: float, requests_per_replica: int, floor: int = 0):
        self.idle_unload_s, self.per_replica, self.floor = idle_unload_s, requests_per_replica, floor

    def __call__(self, ctx):
        now = ctx.current_time or time.time()
        requests = ctx.total_num_requests or 0
        if requests > 0:
            return max(1, math.ceil(requests / self.per_replica)), {"idle_since": None}
        idle_since = ctx.policy_state.get("idle_since") or now
        metrics = ctx.aggregated_metrics or {}
        evict = any(v > 0 for v in (metrics.get("evict") or {}).values())
        if evict or now - idle_since >= self.idle_unload_s:
            return self.floor, {"idle_since": idle_since}
        return ctx.target_num_replicas, {"idle_since": idle_since}


def autoscaling_config(min_replicas: int, max_replicas: int, idle_unload_s: float, pin: bool,
                       requests_per_replica: int) -> dict:
    floor = max(min_replicas, 1 if pin else 0)
    return {
        "min_replicas": floor, "max_replicas": max_replicas, "initial_replicas": floor,
        "upscale_delay_s": 0, "downscale_delay_s": 0, "downscale_to_zero_delay_s": 0,  # IdleUnload times it
        "look_back_period_s": LOOK_BACK_S,
        "target_ongoing_requests": requests_per_replica,
        "policy": {"policy_function": "serve_app.models.residency:IdleUnload",
                   "policy_kwargs": {"idle_unload_s": idle_unload_s, "requests_per_replica": requests_per_replica,
                                     "floor": floor}},
    }


class Residency:
    """The ingress's view of which models are loaded, and the room it makes: a model with
    requests waiting and no replica up for STARVED_S takes the Macs of the least recently
    used model that has no request in flight and may unload (min_replicas 0, not pinned),
    preferring one that frees at least the memory it needs; one a poll, until it fits."""

    def __init__(self, models: Dict[str, "object"], app_name: Optional[str], memory: Dict[str, Optional[float]]):
        self.models = models  # name -> ServedModel
        self.app_name = app_name
        self.memory = memory  # name -> mac_memory_gb one replica declares (None: unknown)
        self.on_demand = {n for n, m in models.items() if m.entry.min_replicas is not None}
        self.running: Dict[str, int] = {}  # replicas up per model, as of the last poll
        self.in_flight = {n: 0 for n in models}
        self.last_used = {n: 0.0 for n in models}
        self.waiting_since: Dict[str, float] = {}
        self.evicted_at: Dict[str, float] = {}
        self.loaded_gauge = Gauge("macfarm_model_loaded", tag_keys=("model",),
                                  description="Replicas of the model up (0: not loaded).")
        self.evictions = Counter("macfarm_model_evictions", tag_keys=("model",),
                                 description="Times the model was unloaded to make room for another.")
        self._task = None

    def start(self) -> None:
        if self.on_demand and self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._poll_forever())

    def loaded(self, name: str) -> Optional[bool]:
        if name not in self.on_demand:
            return True
        return self.running.get(name, 0) > 0 if self.running else None

    def begin(self, name: str) -> None:
        self.in_flight[name] += 1
        self.last_used[name] = time.monotonic()

    def end(self, name: str) -> None:
        self.in_flight[name] -= 1
        self.last_used[name] = time.monotonic()

    async def _poll_forever(self) -> None:
        while True:
            try:
                await self.poll()
            except Exception as e:  # noqa: BLE001 - the controller may be restarting
                logger.warning(f"residency poll failed: {e}")
            await asyncio.sleep(POLL_S)

    async def poll(self) -> None:
        from ray import serve

        status = await asyncio.to_thread(serve.status)
        app = status.applications.get(self.app_name) if self.app_name else None
        if app is None:
            return
        before = dict(self.running)
        for name, m in self.models.items():
            up = sum(int(app.deployments[d].replica_states.get("RUNNING", 0))
                     for d in m.deployments if d in app.deployments)
            self.running[name] = up
            self.loaded_gauge.set(up, tags={"model": name})
            if name in self.on_demand and before.get(name) is not None and (before[name] > 0) != (up > 0):
                logger.info(f"model {name!r} {'loaded' if up else 'unloaded'} ({up} replicas up)")
        now = time.monotonic()
        for name in self.models:
            if self.in_flight[name] and not self.running.get(name):
                self.waiting_since.setdefault(name, now)
                if now - self.waiting_since[name] >= STARVED_S:
                    await self._make_room(name, now)
            else:
                self.waiting_since.pop(name, None)

    async def _make_room(self, starved: str, now: float) -> None:
        idle = [n for n in self.on_demand
                if n != starved and self.running.get(n) and not self.in_flight[n] and not self.models[n].entry.pin
                and self.models[n].entry.min_replicas == 0 and now - self.evicted_at.get(n, -1e9) > EVICT_AGAIN_S]
        if not idle:
            return
        need = self.memory.get(starved)
        # The least recently used of those that free what it needs; smaller ones only when
        # together they could (else unloading them helps no one: wait for a busy one).
        too_small = lambda n: need is not None and (self.memory.get(n) or 0) < need  # noqa: E731
        if all(map(too_small, idle)) and sum(self.memory.get(n) or 0 for n in idle) < need:
            return
        victim = min(idle, key=lambda n: (too_small(n), self.last_used[n]))
        self.evicted_at[victim] = now
        logger.info(f"unloading model {victim!r} (idle, least recently used) to make room for {starved!r}")
        self.evictions.inc(tags={"model": victim})
        m = self.models[victim]
        await asyncio.gather(*[m.evict[g].remote() for g in m.evict for _ in range(max(1, self.running[victim]))],
                             return_exceptions=True)

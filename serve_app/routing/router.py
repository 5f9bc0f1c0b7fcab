"""Prefix-affinity request router: send a prompt where its KV pages are already cached.

Ray Serve runs one router per deployment handle (here: in each ingress replica) and
asks it, for every request, for ranked groups of replicas (`choose_replicas`); Serve
then tries the groups in order and, inside a group, takes the replica with the shortest
queue that accepts the request (`max_ongoing_requests`). This router returns one replica
per group, best first (except in the power-of-two fallback: one group of two).

The policy (which replica, from page hashes, reports and load) is prefix_policy.py;
this module only adapts it to Serve's `RequestRouter` hooks. It must not import
`mlx_worker` (Serve pickles the router module by value and imports it in every
handle's process; mlx is heavy).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import Any, Dict, List, Optional, Sequence

from ray.serve.request_router import (
    PendingRequest,
    ReplicaID,
    ReplicaResult,
    RequestRouter,
    RunningReplica,
)

logger = logging.getLogger("ray.serve")

_MAX_ROUTED = 100_000  # bound on the in-flight bookkeeping of one router


from .prefix_policy import PrefixAffinityConfig, PrefixAffinityPolicy


def extract_field(args: Sequence[Any], kwargs: Mapping[str, Any], name: str) -> Any:
    """Field `name` of a `generate(request: dict)` call's request (first arg or `request=`)."""
    objs = list(args or ())
    if kwargs:
        objs += [kwargs.get("request")] + [v for k, v in kwargs.items() if k != "request"]
    for obj in objs:
        if obj is None:
            continue
        v = obj.get(name) if isinstance(obj, Mapping) else getattr(obj, name, None)
        if v is not None:
            return v
    return None


def extract_page_hashes(args: Sequence[Any], kwargs: Mapping[str, Any]) -> Optional[List[int]]:
    """The `page_hashes` of a `generate(request: dict)` call."""
    h = extract_field(args, kwargs, "page_hashes")
    return None if h is None else (h if isinstance(h, list) else list(h))


class PrefixAffinityRouter(RequestRouter):
    """Ray Serve request router over `PrefixAffinityPolicy` (see the module doc).

    Select it with `request_router_config: {request_router_class:
    "serve_app.routing.router:PrefixAffinityRouter", request_router_kwargs: {...},
    request_routing_stats_period_s: 1}`; kwargs are `PrefixAffinityConfig` fields.
    No FIFOMixin on purpose: a replica chosen for one prompt must go to that prompt.
    """

    def initialize_state(self, **kwargs: Any) -> None:
        self.policy = PrefixAffinityPolicy(PrefixAffinityConfig(**kwargs))
        self._routed: Dict[str, ReplicaID] = {}  # internal_request_id -> replica
        logger.info(
            f"PrefixAffinityRouter for {self._deployment_id}: {self.policy.config.model_dump()}"
        )

    def _get_policy(self) -> PrefixAffinityPolicy:
        if getattr(self, "policy", None) is None:  # initialize_state not called
            self.initialize_state()
        return self.policy

    def _now(self) -> float:
        return time.monotonic()

    # --- replica set ---------------------------------------------------------------------
    def update_replicas(self, replicas: List[RunningReplica]) -> None:
        super().update_replicas(replicas)
        policy = self._get_policy()
        policy.retain(self._replica_id_set)
        now = self._now()
        for r in replicas:
            policy.observe(r.replica_id, _routing_stats(r), now)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._get_policy().forget(replica_id)

    # --- routing -------------------------------------------------------------------------
    async def choose_replicas(
        self,
        candidate_replicas: List[RunningReplica],
        pending_request: Optional[PendingRequest] = None,
    ) -> List[List[RunningReplica]]:
        if pending_request is not None:
            # Back off between full passes instead of spinning when all are busy.
            pending_request.routing_context.should_backoff = True
        if not candidate_replicas:
            return []
        policy = self._get_policy()
        now = self._now()
        by_id = {}
        ongoing: Dict[ReplicaID, Optional[int]] = {}
        use_cache = getattr(self, "_use_replica_queue_len_cache", False)
        for r in candidate_replicas:
            by_id[r.replica_id] = r
            policy.observe(r.replica_id, _routing_stats(r), now)
            ongoing[r.replica_id] = (
                self._replica_queue_len_cache.get(r.replica_id) if use_cache else None
            )
        hashes = _request_hashes(pending_request)
        refused = set(_request_field(pending_request, "avoid_engines") or ())
        avoid = [k for k in by_id if k in policy.replicas and policy.replicas[k].engine_id in refused]
        ranking = policy.route(list(by_id), hashes, now, ongoing, avoid)
        return [[by_id[k] for k in g] for g in ranking.groups]

    def _record(self, pending_request: Optional[PendingRequest], replica_id: ReplicaID) -> None:
        policy = self._get_policy()
        policy.record_routed(replica_id, _request_hashes(pending_request), self._now())
        if pending_request is not None:
            rid = pending_request.metadata.internal_request_id
            prev = self._routed.get(rid)
            if prev != replica_id:
                if prev is not None:
                    policy.request_finished(prev)
                if len(self._routed) >= _MAX_ROUTED:  # completions lost: start over
                    self._routed.clear()
                    for st in policy.replicas.values():
                        st.inflight = 0
                self._routed[rid] = replica_id
                policy.request_started(replica_id)

    def _fulfill_next_pending_request(self, replica: RunningReplica, request_metadata=None):
        # Record the decision the moment Serve assigns the replica (before the replica
        # accepts, which takes a round trip), so the next request of a burst sees it.
        pr = None
        if request_metadata is not None:
            pr = getattr(self, "_pending_requests_by_id", {}).get(
                request_metadata.internal_request_id
            )
        super()._fulfill_next_pending_request(replica, request_metadata)
        try:
            if pr is not None and pr.future.done() and not pr.future.cancelled():
                if pr.future.result() is replica:
                    self._record(pr, replica.replica_id)
        except Exception:  # never break routing over bookkeeping
            logger.debug("PrefixAffinityRouter: early record failed", exc_info=True)

    def on_request_routed(
        self, pending_request: PendingRequest, replica_id: ReplicaID, result: ReplicaResult
    ) -> None:
        self._record(pending_request, replica_id)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        # Only the replica the request is recorded at: a rejected attempt's completion
        # may arrive after the retry was routed elsewhere.
        if self._routed.get(internal_request_id) == replica_id:
            del self._routed[internal_request_id]
            self._get_policy().request_finished(replica_id)


def _routing_stats(replica: Any) -> Optional[Mapping]:
    try:
        return replica.routing_stats
    except Exception:
        return None


def _request_hashes(pending_request: Optional[PendingRequest]) -> Optional[List[int]]:
    h = _request_field(pending_request, "page_hashes")
    try:
        return None if h is None else list(h)
    except TypeError:
        return None


def _request_field(pending_request: Optional[PendingRequest], name: str) -> Any:
    if pending_request is None:
        return None
    try:
        return extract_field(pending_request.args, pending_request.kwargs, name)
    except Exception:
        return None


__all__ = [
    "PrefixAffinityConfig",
    "PrefixAffinityPolicy",
    "PrefixAffinityRouter",
    "extract_page_hashes",
]

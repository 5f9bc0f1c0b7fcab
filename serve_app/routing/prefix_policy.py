"""The prefix-affinity policy: which replica should serve a prompt.

Signals:
- the request's chained page hashes (`request["page_hashes"]`, computed by the ingress
  with `mlx_worker.memory.paging.page_hashes`): hash i names the whole prefix up to page i;
- each replica's `record_routing_stats()` report, which Serve's controller polls every
  `request_routing_stats_period_s` and broadcasts to the handles when it changes
  (`RunningReplica.routing_stats`): `{"running", "waiting", "kv_used",
  "cached_page_hashes", "engine_id"}` (optional: `"page_size"`); seconds stale;
- this router's own decisions, recorded at once (optimistic insert of the routed
  prompt's hashes), so a burst of one tenant sticks to one replica before the next
  report arrives; a fresh report replaces the reported part and drops the optimistic
  inserts it should already show (older than the report minus `report_lag_s`);
- Serve's per-replica queue-length cache (ongoing requests, fresh to the last send).

score(replica) = page_weight * (matched_pages + disk_page_weight * disk_pages)
                 - load_weight * load,
disk_pages = the prompt's pages past the matched ones that the replica's SSD tier holds
(its report's `disk_page_hashes`),
load = ongoing requests (Serve's count, else reported running + waiting, or this
router's in-flight count) + kv_weight * kv_used.
When the load of the candidates is imbalanced (max - min > `imbalance_threshold` and
max > `imbalance_ratio` x min), the router falls back to power-of-two-choices (or, with
`imbalance_mode="filter"`, ranks only the replicas within the threshold of the least
loaded). Queues stay short when the farm is not saturated, so the router also balances
its recent decisions: a replica that got more than `max_share_ratio` x the fair share of
the last ~`balance_window` decisions is ranked last, and a hot prefix spills over to
(and gets cached on) a second replica.

Plain Python with no Ray state, testable on its own; router.py adapts it to Serve's
`RequestRouter` hooks. Like router.py it must not import `mlx_worker` (Serve imports the
router in every handle's process; mlx is heavy).
"""

from __future__ import annotations

import logging
import math
import random
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Dict, Hashable, Iterable, List, Literal, Optional, Sequence

from pydantic import BaseModel, ConfigDict, Field

logger = logging.getLogger("ray.serve")

DEFAULT_PAGE_SIZE = 16  # == mlx_worker.memory.paging.PAGE_SIZE (not imported: see module doc)


class PrefixAffinityConfig(BaseModel):
    """`request_router_kwargs` of `PrefixAffinityRouter` (unknown keys are an error)."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    page_weight: float = Field(1.0, ge=0)
    """Score per matched (cached) prefix page."""
    disk_page_weight: float = Field(0.5, ge=0)
    """Of page_weight: a prefix page past those in memory that the replica holds on its
    SSD tier (`disk_page_hashes`): loading it is cheaper than computing it, dearer than
    finding it in memory."""
    load_weight: float = Field(2.0, ge=0)
    """Score cost per unit of load (one ongoing request), in pages."""
    kv_weight: float = Field(4.0, ge=0)
    """Load added by a full KV pool (kv_used = 1.0), in requests."""
    wait_weight: float = Field(0.5, ge=0)
    """Load added per second of the replica's predicted wait for a new prompt (its queued
    prefill at its measured rate, `queue_wait_s`), in requests."""
    imbalance_threshold: float = Field(8.0, ge=0)
    """Fall back to least-loaded when max load - min load exceeds this (requests)..."""
    imbalance_ratio: float = Field(1.5, ge=0)
    """...and the max load exceeds this times the min load (<= 1: difference only)."""
    imbalance_mode: Literal["pow2", "filter"] = "pow2"
    """pow2: two random candidates, Serve takes the shorter queue. filter: rank by score
    only the replicas within `imbalance_threshold` of the least loaded, the rest last."""
    match_mode: Literal["deepest", "contiguous"] = "deepest"
    """deepest: matched = 1 + the deepest index whose hash the replica has (a chained
    hash names its whole prefix, and the cache evicts leaves before parents, so this is
    the longest cached prefix even if the tracked set is sparse or truncated).
    contiguous: stop at the first page the replica lacks."""
    max_tracked_pages: int = Field(65536, ge=1)
    """Per replica: reported hashes kept (the last ones of the report) and, separately,
    optimistic inserts kept (the newest)."""
    page_size: int = Field(DEFAULT_PAGE_SIZE, ge=1)
    """Tokens per page; a replica reporting another `page_size` gets no cache credit."""
    optimistic_ttl_s: float = Field(30.0, gt=0)
    """Optimistic inserts expire after this even without a report."""
    report_lag_s: float = Field(2.0, ge=0)
    """A report is assumed to reflect decisions older than (its arrival - this)."""
    balance_window: int = Field(256, ge=0)
    """Routing decisions in the (exponentially decayed) window of each replica's share
    of this router's traffic; 0 disables share balancing."""
    max_share_ratio: float = Field(1.2, gt=1.0)
    """A replica whose share exceeds this times the fair share (1 / candidates) is ranked
    after the others, so a hot prefix spills over (and gets cached) elsewhere."""


def imbalanced(loads: Sequence[float], threshold: float, ratio: float) -> bool:
    """Whether the most loaded is over `threshold` above the least and, unless `ratio`
    <= 1 (difference only), over `ratio` times it."""
    if len(loads) < 2:
        return False
    lo, hi = min(loads), max(loads)
    if hi - lo <= threshold:
        return False
    return ratio <= 1.0 or hi > ratio * lo


def prefix_match_len(
    page_hashes: Sequence[int], has: Any, mode: str = "deepest"
) -> int:
    """Number of leading pages of `page_hashes` a replica has cached.

    `has` is a container (`in`) or a predicate. contiguous: length of the longest run
    page_hashes[:n] all present. deepest: 1 + the largest i with page_hashes[i] present
    (equal to contiguous when the set is prefix-closed, as a radix cache's is).
    """
    contains = has if callable(has) else has.__contains__
    if mode == "contiguous":
        n = 0
        for h in page_hashes:
            if not contains(h):
                break
            n += 1
        return n
    for i in range(len(page_hashes) - 1, -1, -1):
        if contains(page_hashes[i]):
            return i + 1
    return 0


def _num(stats: Mapping, key: str, default: float = 0.0) -> float:
    v = stats.get(key, default)
    try:
        v = float(v)
    except (TypeError, ValueError):
        return default
    return v if math.isfinite(v) else default


@dataclass
class ReplicaCacheState:
    """What one router believes about one replica: cached pages and load."""

    engine_id: Optional[str] = None
    reported: frozenset = frozenset()
    on_disk: frozenset = frozenset()  # pages its SSD tier holds (reported)
    optimistic: "OrderedDict[int, float]" = field(default_factory=OrderedDict)  # hash -> t
    has_report: bool = False
    report_time: float = -math.inf
    running: int = 0
    waiting: int = 0
    kv_used: float = 0.0
    queue_wait_s: float = 0.0
    inflight: int = 0  # requests this router routed there and not yet completed
    share: float = 0.0  # decayed count of this router's recent decisions for it
    cache_ok: bool = True  # False: incompatible page size, no cache credit
    last_stats: Any = None  # the stats object (or its content) last applied

    def forget_cache(self) -> None:
        self.reported = self.on_disk = frozenset()
        self.optimistic.clear()

    def contains(self, h: int, now: float, ttl: float) -> bool:
        if h in self.reported:
            return True
        t = self.optimistic.get(h)
        return t is not None and now - t <= ttl

    def expire(self, now: float, ttl: float) -> None:
        opt = self.optimistic
        while opt:
            h, t = next(iter(opt.items()))
            if now - t <= ttl:
                break
            opt.popitem(last=False)

    @property
    def reported_queue(self) -> int:
        return self.running + self.waiting


@dataclass
class ReplicaScore:
    key: Hashable
    matched: int
    load: float
    score: float
    on_disk: int = 0  # pages past `matched` its SSD tier holds


@dataclass
class Ranking:
    groups: List[List[Hashable]]
    scores: Dict[Hashable, ReplicaScore]
    mode: str  # "prefix", "pow2", "filter" or "empty"


class PrefixAffinityPolicy:
    """Per-replica cache/load state and the ranking, keyed by any hashable replica key.

    `now` is passed in everywhere (seconds, monotonic or wall: only differences count),
    so tests can drive time.
    """

    def __init__(
        self,
        config: Optional[PrefixAffinityConfig] = None,
        rng: Optional[random.Random] = None,
    ):
        self.config = config or PrefixAffinityConfig()
        self.replicas: Dict[Hashable, ReplicaCacheState] = {}
        self.rng = rng or random.Random()
        self._warned_page_size = False

    # --- state ---------------------------------------------------------------------------
    def state(self, key: Hashable) -> ReplicaCacheState:
        st = self.replicas.get(key)
        if st is None:
            st = self.replicas[key] = ReplicaCacheState()
        return st

    def forget(self, key: Hashable) -> None:
        """The replica died or left: drop everything known about it."""
        self.replicas.pop(key, None)

    def retain(self, keys: Iterable[Hashable]) -> None:
        """Keep only these replicas (the current replica set)."""
        keep = set(keys)
        for k in [k for k in self.replicas if k not in keep]:
            del self.replicas[k]

    def observe(self, key: Hashable, stats: Optional[Mapping], now: float) -> bool:
        """Apply a replica's routing stats if they are new; True if applied.

        Serve hands the same stats object until the controller broadcasts again, and
        a broadcast rebuilds every replica's object, so a report counts as fresh only
        if its content changed. Missing or empty stats (no report yet) change nothing.
        """
        st = self.state(key)
        if stats is None or stats is st.last_stats:
            return False
        if not isinstance(stats, Mapping) or not stats:
            st.last_stats = stats
            return False
        if st.has_report and stats == st.last_stats:
            st.last_stats = stats
            return False
        st.last_stats = stats
        cfg = self.config

        engine_id = stats.get("engine_id")
        if engine_id is not None:
            engine_id = str(engine_id)
            if st.engine_id is not None and engine_id != st.engine_id:
                # The replica restarted: its cache is gone, and so are our requests there.
                st.forget_cache()
                st.inflight = 0
            st.engine_id = engine_id

        st.running = max(0, int(_num(stats, "running")))
        st.waiting = max(0, int(_num(stats, "waiting")))
        if "kv_used" in stats:
            kv = _num(stats, "kv_used")
        elif "kv_pages_total" in stats:  # raw Engine.stats() format
            kv = _num(stats, "kv_pages_used") / max(1.0, _num(stats, "kv_pages_total", 1.0))
        else:
            kv = st.kv_used
        st.kv_used = min(1.0, max(0.0, kv))
        st.queue_wait_s = max(0.0, _num(stats, "queue_wait_s"))

        page_size = stats.get("page_size")
        st.cache_ok = page_size is None or _num(stats, "page_size", -1) == cfg.page_size
        if not st.cache_ok and not self._warned_page_size:
            self._warned_page_size = True
            logger.warning(
                f"PrefixAffinityRouter: replica {key} reports page_size {page_size}, "
                f"router page_size is {cfg.page_size}; its cache is ignored."
            )

        hashes = stats.get("cached_page_hashes")
        if hashes is not None and st.cache_ok:
            try:
                if len(hashes) > cfg.max_tracked_pages:
                    hashes = list(hashes)[-cfg.max_tracked_pages :]
                st.reported = frozenset(hashes)
            except TypeError:
                st.reported = frozenset()
            # Drop optimistic inserts the report should already reflect.
            cutoff = now - cfg.report_lag_s
            opt = st.optimistic
            while opt:
                h, t = next(iter(opt.items()))
                if t >= cutoff:
                    break
                opt.popitem(last=False)
            for h in [h for h in opt if h in st.reported]:
                del opt[h]
        elif not st.cache_ok:
            st.forget_cache()
        disk = stats.get("disk_page_hashes")
        if disk is not None and st.cache_ok:
            try:
                st.on_disk = frozenset(list(disk)[-cfg.max_tracked_pages :])
            except TypeError:
                st.on_disk = frozenset()
        st.has_report = True
        st.report_time = now
        return True

    def record_routed(
        self, key: Hashable, page_hashes: Optional[Sequence[int]], now: float
    ) -> None:
        """Optimistic insert: the replica will have this prompt's pages cached."""
        st = self.state(key)
        if not page_hashes or not st.cache_ok:
            return
        opt = st.optimistic
        for h in page_hashes:
            if h in opt:
                opt.move_to_end(h)
            opt[h] = now
        over = len(opt) - self.config.max_tracked_pages
        for _ in range(max(0, over)):
            opt.popitem(last=False)

    def request_started(self, key: Hashable) -> None:
        """A new request was routed to `key` (once per request: in-flight and share)."""
        self.state(key).inflight += 1
        w = self.config.balance_window
        if w > 0:
            decay = 1.0 - 1.0 / w
            for st in self.replicas.values():
                st.share *= decay
            self.replicas[key].share += 1.0

    def request_finished(self, key: Hashable) -> None:
        st = self.replicas.get(key)
        if st is not None and st.inflight > 0:
            st.inflight -= 1

    # --- scoring -------------------------------------------------------------------------
    def match_len(self, key: Hashable, page_hashes: Sequence[int], now: float) -> int:
        st = self.replicas.get(key)
        if st is None or not page_hashes or not st.cache_ok:
            return 0
        ttl = self.config.optimistic_ttl_s
        if not st.optimistic:
            return prefix_match_len(page_hashes, st.reported, self.config.match_mode)
        return prefix_match_len(
            page_hashes, lambda h: st.contains(h, now, ttl), self.config.match_mode
        )

    def disk_match_len(self, key: Hashable, page_hashes: Sequence[int], matched: int) -> int:
        """Pages past the `matched` in memory that the replica's SSD tier holds."""
        st = self.replicas.get(key)
        if st is None or not st.on_disk or not page_hashes or not st.cache_ok:
            return 0
        return max(0, prefix_match_len(page_hashes, st.on_disk, self.config.match_mode) - matched)

    def load(self, key: Hashable, ongoing: Optional[int] = None) -> float:
        """Ongoing requests (Serve's count if known) + kv_weight * KV use + wait_weight *
        predicted wait."""
        st = self.replicas.get(key)
        if st is None:
            return float(ongoing or 0)
        if ongoing is not None:
            q = ongoing
        else:
            q = max(st.reported_queue, st.inflight)
        return float(q) + self.config.kv_weight * st.kv_used + self.config.wait_weight * st.queue_wait_s

    def score(
        self,
        key: Hashable,
        page_hashes: Optional[Sequence[int]],
        now: float,
        ongoing: Optional[int] = None,
    ) -> ReplicaScore:
        matched = self.match_len(key, page_hashes or (), now)
        on_disk = self.disk_match_len(key, page_hashes or (), matched)
        load = self.load(key, ongoing)
        cfg = self.config
        pages = matched + cfg.disk_page_weight * on_disk
        return ReplicaScore(key, matched, load, cfg.page_weight * pages - cfg.load_weight * load, on_disk)

    def is_imbalanced(self, loads: Sequence[float]) -> bool:
        return imbalanced(loads, self.config.imbalance_threshold, self.config.imbalance_ratio)

    def rank(
        self,
        keys: Sequence[Hashable],
        page_hashes: Optional[Sequence[int]],
        now: float,
        ongoing: Optional[Mapping[Hashable, Optional[int]]] = None,
    ) -> Ranking:
        """Ranked groups of replica keys, best first (pow2: one group of two)."""
        keys = list(dict.fromkeys(keys))
        if not keys:
            return Ranking([], {}, "empty")
        ongoing = ongoing or {}
        for k in keys:
            st = self.replicas.get(k)
            if st is not None:
                st.expire(now, self.config.optimistic_ttl_s)
        scores = {k: self.score(k, page_hashes, now, ongoing.get(k)) for k in keys}
        loads = [s.load for s in scores.values()]
        if self.is_imbalanced(loads):
            if self.config.imbalance_mode == "pow2":
                pair = self.rng.sample(keys, 2)
                pair.sort(key=lambda k: scores[k].load)
                return Ranking([pair], scores, "pow2")
            cap = min(loads) + self.config.imbalance_threshold
            ok = [k for k in keys if scores[k].load <= cap]
            rest = sorted((k for k in keys if scores[k].load > cap), key=lambda k: scores[k].load)
            groups = self._group(ok, scores)
            if rest:
                groups.append(rest)
            return Ranking(groups, scores, "filter")
        over = self.over_share(keys)
        if over:
            ok = [k for k in keys if k not in over]
            return Ranking(
                self._group(ok, scores) + self._group(list(over), scores), scores, "share"
            )
        return Ranking(self._group(keys, scores), scores, "prefix")

    def shares(self, keys: Sequence[Hashable]) -> Dict[Hashable, float]:
        return {k: (self.replicas[k].share if k in self.replicas else 0.0) for k in keys}

    def over_share(self, keys: Sequence[Hashable]) -> set:
        """Replicas above max_share_ratio x the fair share of recent decisions."""
        cfg = self.config
        if cfg.balance_window <= 0 or len(keys) < 2:
            return set()
        shares = self.shares(keys)
        total = sum(shares.values())
        if total < 4 * len(keys):  # too few decisions to judge
            return set()
        cap = cfg.max_share_ratio * total / len(keys)
        return {k for k, v in shares.items() if v > cap}

    def _group(self, keys: List[Hashable], scores: Dict[Hashable, ReplicaScore]) -> List[List[Hashable]]:
        """One replica per group, best first. Equal scores: lower load, then fewer recent
        decisions, then random. Singletons make the first choice the decision (unless
        that replica is full), so `route` can record it before Serve even sends."""
        shares = self.shares(keys)
        order = sorted(
            keys, key=lambda k: (-scores[k].score, scores[k].load, shares[k], self.rng.random())
        )
        return [[k] for k in order]

    def route(
        self,
        keys: Sequence[Hashable],
        page_hashes: Optional[Sequence[int]],
        now: float,
        ongoing: Optional[Mapping[Hashable, Optional[int]]] = None,
        avoid: Iterable[Hashable] = (),
    ) -> Ranking:
        """`rank`, then record the first choice at once (optimistic insert), so the next
        request of a burst with the same prefix follows it even before Serve sends this
        one. (pow2 leaves the pick to Serve: recorded when Serve assigns the replica.)
        Replicas in `avoid` (they refused this request) are ranked last."""
        ranking = self.rank(keys, page_hashes, now, ongoing)
        avoid = set(avoid)
        if avoid:
            groups = [[k for k in g if k not in avoid] for g in ranking.groups]
            ranking.groups = [g for g in groups if g] + [[k] for k in dict.fromkeys(keys) if k in avoid]
        if page_hashes and ranking.groups and len(ranking.groups[0]) == 1:
            self.record_routed(ranking.groups[0][0], page_hashes, now)
        return ranking

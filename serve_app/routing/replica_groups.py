"""Which replica group a request goes to, when one app has replicas of different sizes.

A group is one Serve deployment of replicas alike (e.g. one Mac each, or two Macs each
for tensor parallel); each has its own prefix-affinity router (router.py), which picks
the replica inside it. Before that, the ingress picks the group, much as that router
picks a replica:

- a prompt goes to the group that got the longest prefix of it before (this ingress
  remembers the page hashes it sent to each group, the newest kept), so a conversation
  or a tenant's system prompt stays where its KV pages are cached;
- unless that group is much busier than another: its requests in flight per unit of
  weight (by default: per replica) exceed the least busy group's by more than
  `imbalance_threshold` and `imbalance_ratio` times (the router's own test,
  `prefix_policy.imbalanced`); then, and for a prompt no group has
  seen, the least busy group takes it (ties: the one furthest below its share of the
  recent requests, so new prefixes spread by weight even when nothing is queued).
"""

import math
from collections import OrderedDict
from typing import Dict, List, Sequence

from .prefix_policy import imbalanced

MAX_TRACKED_PAGES = 200_000  # page hashes remembered, all groups together
BALANCE_WINDOW = 256  # requests in the (exponentially decayed) window of each group's share


class GroupPicker:
    def __init__(self, weights: Dict[str, float], imbalance_threshold: float = 8.0, imbalance_ratio: float = 1.5):
        if not weights or min(weights.values()) <= 0:
            raise ValueError(f"replica groups need positive weights, got {weights}")
        self.weights = dict(weights)
        total = sum(weights.values())
        self.share = {g: w / total for g, w in weights.items()}
        self.imbalance_threshold, self.imbalance_ratio = imbalance_threshold, imbalance_ratio
        self.inflight = {g: 0 for g in weights}  # requests this ingress has in each group now
        self._recent = {g: 0.0 for g in weights}  # decayed count of requests sent
        self._group_of: "OrderedDict[int, str]" = OrderedDict()  # page hash -> group it went to

    def ranked(self, page_hashes: Sequence[int]) -> List[str]:
        """The groups to try for a prompt with these chained page hashes, best first (the
        next ones take it when the first turns it away: all its replicas full)."""
        total = sum(self._recent.values()) or 1.0
        by_load = sorted(self.weights, key=lambda g: (self._load(g), self._recent[g] / total / self.share[g]))
        first = self._cached(page_hashes)
        if first is None or imbalanced([self._load(first), self._load(by_load[0])], self.imbalance_threshold,
                                       self.imbalance_ratio):
            first = by_load[0]
        return [first, *(g for g in by_load if g != first)]

    def started(self, group: str, page_hashes: Sequence[int]) -> None:
        """A request went to `group` (call `finished` when it ends)."""
        self.inflight[group] += 1
        decay = math.exp(-1.0 / BALANCE_WINDOW)
        for g in self._recent:
            self._recent[g] *= decay
        self._recent[group] += 1.0
        for h in page_hashes:
            self._group_of[h] = group
            self._group_of.move_to_end(h)
        while len(self._group_of) > MAX_TRACKED_PAGES:
            self._group_of.popitem(last=False)

    def finished(self, group: str) -> None:
        self.inflight[group] -= 1

    def _load(self, group: str) -> float:
        return self.inflight[group] / self.weights[group]

    def _cached(self, page_hashes: Sequence[int]):
        for h in reversed(page_hashes):  # a chained hash names its whole prefix: deepest first
            group = self._group_of.get(h)
            if group is not None:
                return group
        return None

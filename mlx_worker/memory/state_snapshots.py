"""Recurrent-state snapshots at page boundaries: the prefix cache of hybrid models.

A recurrent state cannot be rebuilt from KV pages, so a prefix hit on a model with
recurrent layers resumes only where a snapshot was taken: the state after the first
k pages of a prompt, keyed by the chained hash of page k (paging.page_hashes). The store
holds at most `max_bytes` of snapshots and evicts the least recently used.
"""

from collections import OrderedDict
from typing import Container, List, Optional

from .recurrent_state import RowState


class StateSnapshots:
    def __init__(self, bytes_per_snapshot: int, max_bytes: int):
        self.bytes_per_snapshot = bytes_per_snapshot
        self.capacity = max_bytes // bytes_per_snapshot if bytes_per_snapshot else 0
        self._by_hash: "OrderedDict[int, RowState]" = OrderedDict()
        self.num_taken = self.num_evicted = 0
        self.version = 0  # changes whenever the set of snapshot hashes does
        self.listener = None  # called with (hash, state) for each new snapshot (the SSD tier files it)

    def __len__(self) -> int:
        return len(self._by_hash)

    @property
    def nbytes(self) -> int:
        return len(self._by_hash) * self.bytes_per_snapshot

    def put(self, page_hash: int, state: RowState) -> None:
        if self.capacity == 0:
            return
        if page_hash in self._by_hash:
            self._by_hash.move_to_end(page_hash)
            return
        self._by_hash[page_hash] = state
        self.num_taken += 1
        self.version += 1
        if self.listener is not None:
            self.listener(page_hash, state)
        while len(self._by_hash) > self.capacity:
            self._by_hash.popitem(last=False)
            self.num_evicted += 1

    def resumable(self, hashes: List[int], cached: Container[int]) -> int:
        """Pages of `hashes` a sequence can resume after: the deepest k whose first k
        pages are all cached and whose page k has a snapshot (0 if none)."""
        n = next((i for i, h in enumerate(hashes) if h not in cached), len(hashes))
        while n > 0 and hashes[n - 1] not in self._by_hash:
            n -= 1
        return n

    def __contains__(self, page_hash: int) -> bool:
        return page_hash in self._by_hash

    def take(self, page_hash: int) -> Optional[RowState]:
        state = self._by_hash.get(page_hash)
        if state is not None:
            self._by_hash.move_to_end(page_hash)
        return state

    def hashes(self, cached: Container[int]) -> List[int]:
        """Snapshot hashes whose page is still cached: where a prefix hit can resume."""
        return [h for h in self._by_hash if h in cached]

    def reset(self) -> None:
        self._by_hash.clear()
        self.version += 1

"""Hybrid models' state snapshots on the SSD.

A recurrent state cannot be rebuilt from KV pages, so a model with recurrent layers
resumes a prefix only where a snapshot of that state was taken (memory/state_snapshots.py):
pages on disk are worth reading back up to a snapshot, and no further. Each snapshot (the
state after a prompt's first k pages) goes to a file named by page k's chained hash, in a
namespace of its own beside the pages', written and checked as page files are.
"""

import itertools
from collections import OrderedDict, deque
from typing import List, Optional, Sequence, Tuple

import mlx.core as mx
import numpy as np

from ..memory.model_caches import StateSpec
from ..memory.recurrent_state import RecurrentStates, RowState
from .page_files import PageFiles, host_view, numpy_dtype

KNOWN = 1 << 16  # snapshot hashes remembered as on disk (never copied out again)


def state_layout(specs: Sequence[StateSpec]) -> List[Tuple[tuple, np.dtype]]:
    """(shape, NumPy dtype) of each array of one sequence's state, layer by layer."""
    return [((1, *shape), numpy_dtype(dtype)) for s in specs for shape, dtype in zip(s.shapes, s.dtypes)]


class DiskStates:
    def __init__(self, files: PageFiles, specs: Sequence[StateSpec]):
        self.files = files
        self.specs = list(specs)
        self.nbytes = files.file_bytes
        self._pending: List[Tuple[int, RowState]] = []
        self._known: "OrderedDict[int, None]" = OrderedDict()  # on disk, by this tier's account
        self._found: deque = deque()  # from the writer thread's scans: snapshots other replicas filed
        self.written = self.loaded = self.unsaved = 0

    def taken(self, h: int, state: RowState) -> None:
        """A snapshot was taken under `h` (StateSnapshots' listener)."""
        if h not in self._known:
            self._pending.append((h, state))

    def capture(self) -> Tuple[List[int], List[List[mx.array]]]:
        """The snapshots taken since the last capture, as lazy host-ready copies."""
        hashes, arrays = [], []
        for h, state in self._pending:
            parts = RecurrentStates.arrays(state.batch)
            if [(tuple(a.shape), numpy_dtype(a.dtype)) for a in parts] != self.files.layout:
                self.unsaved += 1  # an entry the probe did not see (None then): not a layout to file
                continue
            hashes.append(h)
            arrays.append([host_view(a) for a in parts])
            self.remember(h)
        self._pending = []
        return hashes, arrays

    def remember(self, h: int) -> None:
        self._known[h] = None
        self._known.move_to_end(h)
        if len(self._known) > KNOWN:
            self._known.popitem(last=False)

    def found(self, hashes: Sequence[int]) -> None:
        """Snapshots a scan of the directory found (on the writer thread)."""
        self._found.extend(h for h in hashes if h not in self._known)

    def hashes(self, limit: int) -> List[int]:
        """The newest `limit` snapshots on disk by this tier's account, oldest first: where
        a prefix on disk can be resumed (for the router)."""
        while self._found:
            self.remember(self._found.popleft())
        return list(itertools.islice(reversed(self._known), limit))[::-1]

    def write(self, h: int, arrays: Sequence[np.ndarray]) -> bool:
        """On the writer thread."""
        if self.files.write(h, arrays):
            self.written += 1
            return True
        return False

    def has(self, h: int) -> bool:
        return self.files.has(h)

    def read(self, h: int) -> Optional[RowState]:
        """The snapshot filed under `h`, or None (absent, or damaged: then deleted)."""
        arrays = self.files.read(h)
        if arrays is None:
            self._known.pop(h, None)  # to be filed again when computed
            return None
        it = iter(arrays)
        batch = tuple(tuple(mx.array(next(it)).view(dtype) for dtype in spec.dtypes) for spec in self.specs)
        self.loaded += 1
        self.remember(h)
        return RowState(batch, 0)

"""A step's view of KV memory: the one place the worker asks for what a forward reads
and writes.

Three stores hold a sequence's context: the paged pool (attention K/V, by page
table: paged_cache.py), the staged dense copy of the decode batch (decode_kv.py), and
recurrent layers' per-row state (recurrent_state.py), with snapshots of that state at
page boundaries for the prefix cache (state_snapshots.py). `StepKV` puts them behind
three calls: `decode_rows` orders a step's decode rows and stages their KV,
`forward` gives one forward its mlx-lm cache list, and `ForwardKV.done` leaves the
forward's recurrent states in its sequences (and snapshots them where a prefill chunk
ends on a page boundary), returning every array the forward's dispatch must include.
"""

from typing import List, Optional, Sequence, Tuple

import mlx.core as mx

from .decode_kv import DecodeKV, DecodeStaging
from .kv_pool import KVPool
from .model_caches import CacheTree
from .paged_cache import BatchLayout, forward_caches
from .recurrent_state import RecurrentStates, RowState


class ForwardKV:
    """One forward's caches, nested as the model's `make_cache` nests them."""

    def __init__(self, caches: list, state_caches: list, seqs: Sequence, staged: Optional[DecodeKV],
                 step_kv: "StepKV"):
        self.caches = caches
        self._state_caches, self._seqs, self._staged, self._kv = state_caches, seqs, staged, step_kv

    def done(self, snapshot_ends: Sequence[Optional[int]] = ()) -> List[mx.array]:
        """After the model ran: each sequence keeps its row of the new recurrent states;
        a row whose prefill ended at position `snapshot_ends[i]` on a page boundary
        leaves a snapshot. The arrays to dispatch with the forward's outputs (still lazy)."""
        arrays = self._staged.arrays() if self._staged is not None else []
        if not self._state_caches:
            return arrays
        batch = RecurrentStates.collect(self._state_caches)
        for i, seq in enumerate(self._seqs):
            seq.state = RowState(batch, i)
        return arrays + RecurrentStates.arrays(batch) + self._kv.snapshot(self._seqs, snapshot_ends)


class StepKV:
    def __init__(self, pool: KVPool, tree: CacheTree, staging_bytes: int = 0, scratch_bytes: int = 0,
                 snapshots=None, head_groups: bool = False):
        self.pool = pool
        self.tree = tree
        self.states = RecurrentStates(tree.states)
        self.snapshots = snapshots  # state_snapshots.StateSnapshots of a model with recurrent layers
        self.staging = DecodeStaging(pool, staging_bytes, scratch_bytes)
        self.head_groups = head_groups  # the model splits heads into groups: masks get one more axis

    def decode_rows(self, rows: list, dispatch) -> Tuple[list, Optional[DecodeKV]]:
        """A step's decode rows (seq, position), in the order their KV is staged in, and
        that staged KV (None: over the staging budget, read from the pool). The copies
        that bring the staged batch up to date are dispatched here, before the step."""
        if not rows:
            self.staging.reset()
            return rows, None
        return self.staging.stage(rows, dispatch)

    def forward(self, seqs: Sequence, offsets: Sequence[int], L: int, staged: Optional[DecodeKV] = None) -> ForwardKV:
        """The caches of one forward whose row b feeds `L` tokens from position offsets[b]."""
        blocks = [s.images.blocks if s.images is not None else None for s in seqs]
        layout = BatchLayout([s.pages for s in seqs], offsets, L, self.pool.page_size, self.head_groups,
                             blocks if any(blocks) else None)
        state_caches = self.states.caches([s.state for s in seqs]) if self.states else []
        caches = forward_caches(self.tree, self.pool, layout, state_caches, staged)
        return ForwardKV(caches, state_caches, seqs, staged, self)

    def snapshot(self, seqs: Sequence, ends: Sequence[Optional[int]]) -> List[mx.array]:
        """Snapshot the state of rows whose prefill ends (`ends`) on a page boundary."""
        if self.snapshots is None:
            return []
        arrays = []
        for seq, end in zip(seqs, ends):
            if end is not None and end % self.pool.page_size == 0:
                snap = RecurrentStates.snapshot(seq.state)
                self.snapshots.put(seq.full_page_hashes(end // self.pool.page_size)[-1], snap)
                arrays += RecurrentStates.arrays(snap.batch)
        return arrays

    def reset(self) -> None:
        """After a failed step: the staged batch and the snapshots it may have left."""
        self.staging.reset()
        if self.snapshots is not None:
            self.snapshots.reset()

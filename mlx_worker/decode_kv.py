"""A dense copy of the decode batch's KV, kept across steps and batch changes.

Gathering every row's pages out of the pool costs each decode step a copy of the whole
batch's KV per layer, and attention then reads that copy again. Instead each decode row
owns a slot of (slots, H, capacity, D) arrays per layer: a step scatters its new token's
K/V there (the pool still gets its copy, for the prefix cache and later rebuilds) and
hands attention the first B slots, as mlx-lm's own KVCache hands out a slice.

When the batch changes, only the change is copied: a joining row gathers its history
from the pool into a free slot, and a leaving row's slot is refilled by moving the last
row into it, so the batch stays the slots 0..B-1 (the worker orders the decode rows by
slot). The copies are read in a dispatch of their own before the step (`edits`): a read
of an array before a write to it in one graph makes MLX copy the whole array.

The arrays grow by steps and are kept; when growing them would pass `max_bytes`, the
batch is restaged in arrays that fit it exactly, and past that decode gathers from the
pool instead.
"""

from typing import Dict, List, Optional, Sequence as Seq, Tuple

import mlx.core as mx
import numpy as np

from .kv_pool import KVPool, kv_bytes_per_token
from .paged_cache import BatchLayout

CAPACITY_STEP = 256  # positions added at a time, as mlx-lm's KVCache
SLOT_STEP = 8  # slots added at a time


def _round_up(n: int, step: int) -> int:
    return -(-n // step) * step


def _grow(a: mx.array, axis: int, size: int) -> mx.array:
    shape = list(a.shape)
    shape[axis] = size - a.shape[axis]
    return mx.concatenate([a, mx.zeros(shape, a.dtype)], axis=axis)


class DecodeKV:
    """The staged K/V of the decode batch; `update` is called by each layer's cache."""

    def __init__(self, pool: KVPool):
        self.pool = pool
        self.slots = self.capacity = 0
        self.keys: List[mx.array] = []
        self.values: List[mx.array] = []
        for layer, s in enumerate(pool.specs):
            self.keys.append(mx.zeros((0, s.n_kv_heads, 0, s.k_dim), pool.keys[layer].dtype))
            self.values.append(mx.zeros((0, s.n_kv_heads, 0, s.v_dim), pool.values[layer].dtype))
        self._heads = {h: mx.arange(h)[None, :] for h in {s.n_kv_heads for s in pool.specs}}
        self._edits: Optional[list] = None

    def resize(self, slots: int, capacity: int) -> None:
        for arrays in (self.keys, self.values):
            for i, a in enumerate(arrays):
                if slots > self.slots:
                    a = _grow(a, 0, slots)
                if capacity > self.capacity:
                    a = _grow(a, 2, capacity)
                arrays[i] = a
        self.slots, self.capacity = max(slots, self.slots), max(capacity, self.capacity)

    def edits(self, moves: List[Tuple[int, int]], joins: List[int], join_layout: Optional[BatchLayout]) -> List[mx.array]:
        """Read the rows this step moves (src -> dst slot) and the pool history of the rows
        that join (into the `joins` slots); `update` writes them. Returns what to evaluate."""
        self._edits, arrays = [], []
        if moves:
            dst, src = (mx.array(np.array(x, np.int32)) for x in zip(*moves))
        if joins:
            join_slots = mx.array(np.array(joins, np.int32))
        for layer in range(len(self.keys)):
            e = []
            if moves:
                e.append((dst, self.keys[layer][src], self.values[layer][src]))
            if joins:
                e.append((join_slots, *self.pool.read(layer, join_layout.table)))
            self._edits.append(e)
            arrays += [a for _, k, v in e for a in (k, v)]
        return arrays

    def step(self, offsets: List[int]) -> None:
        self.B, self.Lk = len(offsets), max(offsets) + 1
        self._rows = mx.arange(self.B)[:, None]
        self._pos = mx.array(np.asarray(offsets, np.int32))[:, None]

    def update(self, layer: int, keys: mx.array, values: mx.array):
        """Store this step's (B, H, 1, D) keys/values; return K/V of slots 0..B-1 up to
        the longest row."""
        K, V = self.keys[layer], self.values[layer]
        has_values = V.shape[-1] > 0  # an index-key cache stores no values (MLX can't scatter empty rows)
        for dst, k, v in self._edits[layer]:  # whole moved rows, or joined history 0..n-1
            K[dst, :, : k.shape[2]] = k
            if has_values:
                V[dst, :, : v.shape[2]] = v
        idx = (self._rows, self._heads[keys.shape[1]], self._pos)
        K[idx] = keys[:, :, 0, :]
        if has_values:
            V[idx] = values[:, :, 0, :]
        return K[: self.B, :, : self.Lk], V[: self.B, :, : self.Lk]

    def arrays(self) -> List[mx.array]:
        return self.keys + self.values


class DecodeStaging:
    """Keeps the DecodeKV of consecutive decode steps; rows join and leave one by one."""

    def __init__(self, pool: KVPool, max_bytes: int):
        self.pool = pool
        self.max_bytes = max_bytes
        self.bytes_per_position = kv_bytes_per_token(pool.specs, pool.dtype)
        self.current: Optional[DecodeKV] = None
        self._slot: Dict[tuple, int] = {}  # row key -> slot
        self._pos: Dict[tuple, int] = {}  # row key -> position it wrote last
        self.num_staged = self.num_gathered = 0  # decode steps that read each
        self.num_restaged = 0  # staged steps that first copied the whole batch in from the pool
        self.num_joined = self.num_moved = 0  # rows copied in: from the pool, from another slot

    @staticmethod
    def _key(seq) -> tuple:
        return (seq.arrival, seq.num_preemptions)  # a recomputed sequence is a new row

    def stage(self, decode: Seq, dispatch) -> Tuple[list, Optional[DecodeKV]]:
        """This step's decode rows (seq, position) in slot order and their staged KV, the
        batch's changes dispatched; (rows, None) when the batch is over the memory cap.

        Rows that continue keep their slots, except that the last ones move into the slots
        of rows that left; rows that join (or come back after a gap) take the slots after.
        """
        B = len(decode)
        shape = self._shape(B, max(p for _, p in decode) + 1)
        if shape is None:
            self.reset()
            self.num_gathered += 1
            return list(decode), None
        slots, capacity = shape
        cur = self.current
        if cur is not None and (slots < cur.slots or capacity < cur.capacity):
            self.reset()  # restaged smaller: every row joins from the pool
            self.num_restaged += 1
            cur = None
        keys = [self._key(s) for s, _ in decode]
        going = [i for i, (k, (_, p)) in enumerate(zip(keys, decode)) if self._pos.get(k) == p - 1]
        joining = [i for i in range(B) if self._pos.get(keys[i]) != decode[i][1] - 1]
        n = len(going)
        new_slot = {i: self._slot[keys[i]] for i in going if self._slot[keys[i]] < n}
        holes = iter(sorted(set(range(n)) - set(new_slot.values())))
        moves = []
        for i in going:
            if i not in new_slot:
                new_slot[i] = next(holes)
                moves.append((new_slot[i], self._slot[keys[i]]))
        rows = sorted(going, key=new_slot.get) + joining
        ordered = [decode[i] for i in rows]
        if cur is None:
            cur = self.current = DecodeKV(self.pool)
        cur.resize(slots, capacity)
        join_layout = None
        if joining:
            new = [decode[i] for i in joining]
            join_layout = BatchLayout([s.pages for s, _ in new], [p - 1 for _, p in new], 1, self.pool.page_size)
        edits = cur.edits(moves, list(range(n, B)), join_layout)
        if edits:
            dispatch(*edits)
        cur.step([p for _, p in ordered])
        self._slot = {self._key(s): i for i, (s, _) in enumerate(ordered)}
        self._pos = {self._key(s): p for s, p in ordered}
        self.num_staged += 1
        self.num_joined += len(joining)
        self.num_moved += len(moves)
        return ordered, cur

    def _shape(self, rows: int, positions: int) -> Optional[Tuple[int, int]]:
        """Slots and capacity for this step: the current arrays, grown where the batch
        needs it and rounded up as far as `max_bytes` allows; when that passes the cap,
        arrays that fit just this batch (a smaller rectangle: the arrays only grow while
        kept); None when even those pass it."""
        cur = self.current
        if cur is not None and rows <= cur.slots and positions <= cur.capacity:
            return cur.slots, cur.capacity
        if not self.bytes_per_position:  # no attention layers (a recurrent model): nothing to copy
            return _round_up(rows, SLOT_STEP), _round_up(positions, CAPACITY_STEP)
        budget = self.max_bytes // self.bytes_per_position  # positions
        spare = (budget / (rows * positions)) ** 0.5
        bases = [(cur.slots, cur.capacity)] if cur is not None else []
        for base_slots, base_capacity in bases + [(0, 0)]:
            slots, capacity = max(base_slots, rows), max(base_capacity, positions)
            if slots * capacity > budget:
                continue
            # Room to spare is split alike between more rows and longer ones, so that near the cap
            # neither a join nor the longest row's next position has to restage at once.
            slots = max(slots, min(_round_up(rows, SLOT_STEP), int(rows * spare), budget // capacity))
            capacity = max(capacity, min(_round_up(positions, CAPACITY_STEP), budget // slots))
            return slots, capacity
        return None

    def reset(self) -> None:
        self.current, self._slot, self._pos = None, {}, {}

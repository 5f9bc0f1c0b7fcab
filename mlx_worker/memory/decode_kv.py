"""A dense copy of the decode batch's KV, kept across steps and batch changes.

Gathering every row's pages out of the pool costs each decode step a copy of the whole
batch's KV per layer, and attention then reads that copy again. Instead each decode row
owns a slot of (slots, H, capacity, D) arrays per layer: a step scatters its new token's
K/V there (the pool still gets its copy, for the prefix cache and later rebuilds) and
hands attention the first B slots, as mlx-lm's own KVCache hands out a slice.

When the batch changes, only the change is copied: a joining row gathers its history
from the pool into a free slot, and a leaving row's slot is refilled by moving the last
row into it, so the batch stays the slots 0..B-1 (the worker orders the decode rows by
slot). These copies run in dispatches of their own before the step (`edit`): a read of
an array before a write to it in one graph makes MLX copy the whole array. They go a
group of layers at a time, so what they hold in flight stays within `scratch_bytes`
(the engine gives them the step's activation budget: no step runs beside them).

Quantized pools (`kv_bits`) are staged as they are stored: each of a layer's K and V
is its parts (packed values, scales, biases), each staged alike, and a step quantizes
its new token as the pool does.

The arrays are kept while the batch fits them. When it outgrows them they are rebuilt,
not grown: the old arrays go first and every row is gathered again from the pool, a
group of layers at a time, so staging never holds more than `max_bytes` (growing by
concatenation held the old and the new arrays at once, twice the cap). Past the cap
decode gathers from the pool instead.
"""

from typing import Dict, List, Optional, Tuple
from typing import Sequence as Seq

import mlx.core as mx
import numpy as np

from .kv_pool import KVPool
from .paged_cache import BatchLayout

CAPACITY_STEP = 256  # positions added at a time, as mlx-lm's KVCache
SLOT_STEP = 8  # slots added at a time


def _parts(x) -> tuple:
    """A K or V as read from the pool: its parts (one array, or a quantized triplet)."""
    return x if isinstance(x, tuple) else (x,)


def _round_up(n: int, step: int) -> int:
    return -(-n // step) * step


class DecodeKV:
    """The staged K/V of the decode batch; `update` is called by each layer's cache."""

    def __init__(self, pool: KVPool, slots: int, capacity: int):
        self.pool = pool
        self.slots, self.capacity = slots, capacity
        self.quantized = getattr(pool, "quantization", None) is not None

        def staged(stored):  # each part (heads, pool slots, dim) -> (slots, heads, capacity, dim)
            # Zeros, not empty: attention multiplies the masked positions by 0, and 0 x NaN is NaN.
            return [mx.zeros((slots, a.shape[0], capacity, a.shape[2]), a.dtype) for a in stored]

        layers = [pool.parts(i) for i in range(len(pool.specs))]
        self.keys = [staged(k) for k, _ in layers]
        self.values = [staged(v) for _, v in layers]
        self._heads = {h: mx.arange(h)[None, :] for h in {s.n_kv_heads for s in pool.specs}}
        self._bytes_per_position = [pool.layer_bytes_per_token(i) for i in range(len(pool.specs))]

    def edit(self, moves: List[Tuple[int, int]], joins: List[int], join_layout: Optional[BatchLayout],
             dispatch, scratch_bytes: int) -> None:
        """Copy the rows this step moves (src -> dst slot), then the pool history of the
        rows that join (into the `joins` slots), in dispatches before the step, a group of
        layers at a time: the copies in flight hold at most `scratch_bytes` (or one layer)."""
        if not moves and not joins:
            return
        dst, src = (mx.array(np.array(x, np.int32)) for x in zip(*moves)) if moves else (None, None)
        join_slots = mx.array(np.array(joins, np.int32)) if joins else None
        width = len(moves) * self.capacity + (len(joins) * join_layout.Lk if joins else 0)  # positions a layer
        group, held = [], 0
        for layer, per_position in enumerate(self._bytes_per_position):
            if group and held + width * per_position > scratch_bytes:
                self._edit_layers(group, dst, src, join_slots, join_layout, dispatch)
                group, held = [], 0
            group.append(layer)
            held += width * per_position
        self._edit_layers(group, dst, src, join_slots, join_layout, dispatch)

    def _edit_layers(self, layers: List[int], dst, src, join_slots, join_layout, dispatch) -> None:
        if src is not None:
            moved = {i: ([a[src] for a in self.keys[i]], [a[src] for a in self.values[i]]) for i in layers}
            dispatch(*[a for kv in moved.values() for part in kv for a in part])  # read before the writes below
        for i in layers:
            edits = [(dst, *moved[i])] if src is not None else []
            if join_slots is not None:
                edits.append((join_slots, *map(_parts, self.pool.read(i, join_layout.table))))
            for slots, ks, vs in edits:
                for stored, new in ((self.keys[i], ks), (self.values[i], vs)):
                    for S, x in zip(stored, new):
                        if S.shape[-1]:  # an index-key cache stores no values (MLX can't scatter empty rows)
                            S[slots, :, : x.shape[2]] = x
        dispatch(*[a for i in layers for a in self.keys[i] + self.values[i]])

    def step(self, offsets: List[int]) -> None:
        self.B, self.Lk = len(offsets), max(offsets) + 1
        self._rows = mx.arange(self.B)[:, None]
        self._pos = mx.array(np.asarray(offsets, np.int32))[:, None]

    def update(self, layer: int, keys: mx.array, values: mx.array):
        """Store this step's (B, H, 1, D) keys/values; return K/V of slots 0..B-1 up to
        the longest row (quantized: as (packed, scales, biases))."""
        idx = (self._rows, self._heads[keys.shape[1]], self._pos)
        out = []
        for stored, new in ((self.keys[layer], keys), (self.values[layer], values)):
            if stored[0].shape[-1]:
                for S, part in zip(stored, self.pool.encode(new[:, :, 0, :])):
                    S[idx] = part
            parts = tuple(S[: self.B, :, : self.Lk] for S in stored)
            out.append(parts if self.quantized else parts[0])
        return tuple(out)

    def arrays(self) -> List[mx.array]:
        return [a for layer in self.keys + self.values for a in layer]


class DecodeStaging:
    """Keeps the DecodeKV of consecutive decode steps; rows join and leave one by one."""

    def __init__(self, pool: KVPool, max_bytes: int, scratch_bytes: int = 0):
        self.pool = pool
        self.max_bytes = max_bytes
        self.scratch_bytes = scratch_bytes  # the rows being copied in may hold this much more (0: a layer)
        self.bytes_per_position = sum(pool.layer_bytes_per_token(i) for i in range(len(pool.specs)))
        self.current: Optional[DecodeKV] = None
        self._slot: Dict[tuple, int] = {}  # row key -> slot
        self._pos: Dict[tuple, int] = {}  # row key -> position it wrote last
        self.num_staged = self.num_gathered = 0  # decode steps that read each
        self.num_restaged = 0  # staged steps that rebuilt the arrays (grown or shrunk), every row copied in
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
        if self.current is not None and shape != (self.current.slots, self.current.capacity):
            self.reset()  # rebuilt to the new shape: every row joins from the pool
            self.num_restaged += 1
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
        if self.current is None:
            self.current = DecodeKV(self.pool, *shape)
        cur = self.current
        join_layout = None
        if joining:
            new = [decode[i] for i in joining]
            join_layout = BatchLayout([s.pages for s, _ in new], [p - 1 for _, p in new], 1, self.pool.page_size)
        cur.edit(moves, list(range(n, B)), join_layout, dispatch, self.scratch_bytes)
        cur.step([p for _, p in ordered])
        self._slot = {self._key(s): i for i, (s, _) in enumerate(ordered)}
        self._pos = {self._key(s): p for s, p in ordered}
        self.num_staged += 1
        self.num_joined += len(joining)
        self.num_moved += len(moves)
        return ordered, cur

    def _shape(self, rows: int, positions: int) -> Optional[Tuple[int, int]]:
        """Slots and capacity for this step: the current arrays while the batch fits them,
        else arrays for this batch with room to grow, rounded up as far as `max_bytes`
        allows; None when even the batch alone passes it."""
        cur = self.current
        if cur is not None and rows <= cur.slots and positions <= cur.capacity:
            return cur.slots, cur.capacity
        if not self.bytes_per_position:  # no attention layers (a recurrent model): nothing to copy
            return _round_up(rows, SLOT_STEP), _round_up(positions, CAPACITY_STEP)
        budget = self.max_bytes // self.bytes_per_position  # positions
        if rows * positions > budget:
            return None
        # Room to spare is split alike between more rows and longer ones, so that near the cap
        # neither a join nor the longest row's next position has to rebuild at once.
        spare = (budget / (rows * positions)) ** 0.5
        slots = max(rows, min(_round_up(rows, SLOT_STEP), int(rows * spare), budget // positions))
        capacity = max(positions, min(_round_up(positions, CAPACITY_STEP), budget // slots))
        return slots, capacity

    def reset(self) -> None:
        self.current, self._slot, self._pos = None, {}, {}

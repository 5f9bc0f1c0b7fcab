"""mlx-lm cache objects over the paged pool, so unmodified mlx-lm models run on it."""

from typing import Dict, List, Optional, Sequence, Tuple

import mlx.core as mx
import numpy as np

from .model_caches import CacheTree
from .kv_pool import KVPool


class BatchLayout:
    """Where one forward's rows live in the pool.

    Row b feeds `L` tokens at positions offsets[b] .. offsets[b] + L - 1 and attends to
    positions 0 .. offsets[b] + L - 1. Rows may have different lengths (ragged decode);
    keys past a row's end are padding, hidden by the mask. `blocks`: per row, runs of
    positions [start, end) whose tokens attend to each other both ways (the image tokens
    of Gemma 4's larger checkpoints); a row's chunk never ends inside one (scheduler).
    """

    def __init__(self, page_tables: Sequence[Sequence[int]], offsets: Sequence[int], L: int, page_size: int,
                 head_groups: bool = False, blocks: Optional[Sequence[Optional[List[Tuple[int, int]]]]] = None):
        offs = np.asarray(offsets, dtype=np.int64)
        self.bidirectional = self._bidirectional(offs, L, blocks) if blocks else None
        self.uniform = bool((offs == offs[0]).all())
        self.head_groups = head_groups  # the model splits heads into groups: masks get one more axis
        self.L = L
        self.Lk = int(offs.max()) + L
        self.offsets_np = offs
        self.page_tables = page_tables
        self.page_size = page_size
        pos = offs[:, None] + np.arange(L)[None]  # (B, L)
        if L == 1:  # a decode step: one page lookup a row
            page = np.array([pages[o // page_size] for pages, o in zip(page_tables, offsets)], dtype=np.int64)
            writes = page[:, None] * page_size + pos % page_size
        else:
            writes = self._slots(pos)
        self.write_slots = mx.array(writes[:, None].astype(np.int32))  # (B, 1, L)
        # One int when every row is at the same position: some models' code needs it.
        self.offset = int(offs[0]) if self.uniform else mx.array(offs.astype(np.int32))
        self._table: Optional[mx.array] = None
        self._masks: Dict[Optional[int], Optional[mx.array]] = {}

    def _slots(self, pos: np.ndarray) -> np.ndarray:
        """Pool slots of positions `pos` (B, n), each row's below its own end."""
        P = self.page_size
        out = np.zeros(pos.shape, dtype=np.int64)
        for b, pages in enumerate(self.page_tables):
            p = pos[b]
            n = int(p.max()) + 1 if p.size else 0
            row_pages = np.asarray(pages[: (n + P - 1) // P], dtype=np.int64)
            out[b] = row_pages[p // P] * P + p % P
        return out

    @property
    def table(self) -> mx.array:
        """(B, 1, Lk): the pool slot of every key position of each row; padding past a
        row's end reads slot 0 (hidden by the mask). Built on first use: staged decode
        steps never read the pool."""
        if self._table is None:
            ends = self.offsets_np + self.L
            pos = np.broadcast_to(np.arange(self.Lk), (len(ends), self.Lk))
            table = self._slots(np.minimum(pos, ends[:, None] - 1))
            table[pos >= ends[:, None]] = 0
            self._table = mx.array(table[:, None].astype(np.int32))
        return self._table

    def mask(self, window: Optional[int] = None) -> Optional[mx.array]:
        if window not in self._masks:
            self._masks[window] = self._make_mask(window)
        return self._masks[window]

    def _bidirectional(self, offs: np.ndarray, L: int, blocks) -> Optional[np.ndarray]:
        """(B, L, Lk): where a row's query and key lie in one of its blocks, or None."""
        Lk = int(offs.max()) + L
        out = None
        for b, (o, row_blocks) in enumerate(zip(offs, blocks)):
            for s, t in row_blocks or ():
                q0, q1 = max(s, o), min(t, o + L)
                if q0 < q1:
                    out = np.zeros((len(offs), L, Lk), dtype=bool) if out is None else out
                    out[b, q0 - o : q1 - o, s:q1] = True
        return out

    def _make_mask(self, window: Optional[int]) -> Optional[mx.array]:
        uniform = self.uniform and self.bidirectional is None
        if uniform and self.L == 1 and (window is None or self.Lk <= window):
            return None  # every key is visible to every row
        offsets = self.offsets_np[:1] if uniform else self.offsets_np
        q = offsets[:, None] + np.arange(self.L)[None]  # (B, L)
        k = np.arange(self.Lk)[None, None]  # (1, 1, Lk)
        m = k <= q[:, :, None]
        if window is not None:
            m &= k > q[:, :, None] - window
        if self.bidirectional is not None:  # as mlx-vlm's Gemma 4 overlays it on either kind of mask
            m |= self.bidirectional
        if uniform:
            return mx.array(m[0])  # (L, Lk): broadcasts against any head layout
        return mx.array(m[:, None, None] if self.head_groups else m[:, None])  # (B, 1, [1,] L, Lk)


class PagedKVCache:
    """One layer's cache for one forward: writes new K/V to the pool, reads the rows back.

    Follows the mlx-lm cache protocol that attention layers use (`offset`,
    `update_and_fetch`, `make_mask`, and `keys_and_values` for layers that reuse an
    earlier layer's KV); the pool holds the only copy of the KV. As a chunked-attention
    cache (llama4) it keeps every position (`start_position` 0): the model's chunk mask
    hides the ones outside the chunk.
    """

    start_position = 0

    def __init__(self, pool: KVPool, layer: int, layout: BatchLayout, staged=None):
        self.pool = pool
        self.layer = layer
        self.layout = layout
        self.staged = staged  # a decode_kv.DecodeKV: read the decode rows from it
        self.keys = self.values = None  # this forward's K/V as attention sees them
        if getattr(pool, "quantization", None):  # mlx-lm's attention reads quantized K/V where a cache has these
            self.bits, self.group_size = pool.quantization

    @property
    def offset(self):
        return self.layout.offset

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        self.pool.write(self.layer, self.layout.write_slots, keys, values)
        if self.staged is not None:
            self.keys, self.values = self.staged.update(self.layer, keys, values)
        else:
            self.keys, self.values = self.pool.read(self.layer, self.layout.table)
        return self.keys, self.values

    def keys_and_values(self):
        return self.keys, self.values

    def maybe_trim_front(self) -> None:
        pass

    def make_mask(self, N: int, return_array: bool = False, window_size: Optional[int] = None):
        kept = self.pool.specs[self.layer].window
        if kept is not None:  # as mlx-lm's RotatingKVCache: a decode step sees only the positions it keeps
            window_size = min(window_size or kept, kept) if N == 1 else window_size or kept
        return self.layout.mask(window_size)

    def is_trimmable(self) -> bool:
        return False

    @property
    def state(self):
        raise NotImplementedError("paged caches live in the engine's pool")

    def empty(self) -> bool:
        return False


def forward_caches(tree: CacheTree, pool: KVPool, layout: BatchLayout, state_caches: list, staged=None) -> list:
    """The cache list for one forward, nested as the model's `make_cache` nests it: paged
    KV for attention layers, `state_caches` (recurrent_state.py) for recurrent ones."""
    return tree.build(lambda i: PagedKVCache(pool, i, layout, staged), lambda j: state_caches[j])

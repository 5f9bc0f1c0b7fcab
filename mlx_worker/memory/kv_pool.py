"""The paged KV pool: one preallocated K and V array per attention layer."""

import os
from typing import List, Optional

import mlx.core as mx

from .model_caches import LayerSpec

STATELESS_PAGES = 65536  # pages of a model without attention layers (no KV to hold)


def kv_bytes_per_token(specs: List[LayerSpec], dtype: mx.Dtype) -> int:
    return sum(s.n_kv_heads * (s.k_dim + s.v_dim) for s in specs) * dtype.size


def device_memory() -> int:
    """Memory the device may use: Metal's working-set limit, else physical RAM."""
    info = mx.device_info() if hasattr(mx, "device_info") else {}
    if "max_recommended_working_set_size" in info:
        return int(info["max_recommended_working_set_size"])
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def kv_budget(weights_bytes: int, memory_fraction: float) -> int:
    """Bytes for KV: `memory_fraction` of the device memory left after the weights."""
    return int(memory_fraction * max(0, device_memory() - weights_bytes))


def pool_pages(
    per_token: int,
    page_size: int,
    weights_bytes: int,
    memory_fraction: float,
    max_total_tokens: Optional[int] = None,
    reserved_bytes: int = 0,
) -> int:
    """Pages of `per_token` KV bytes a token that fit `memory_fraction` of device memory
    left after the weights, less `reserved_bytes` of that budget (recurrent state). A
    model without attention layers gets pages that hold no KV: they only index the
    prefix cache."""
    if max_total_tokens is not None:
        return max(1, max_total_tokens // page_size)
    if per_token == 0:
        return STATELESS_PAGES
    pages = (kv_budget(weights_bytes, memory_fraction) - reserved_bytes) // (per_token * page_size)
    if pages < 1:
        raise ValueError("no memory left for the KV pool; lower the model size or set max_total_tokens")
    return pages


class KVPool:
    """K and V storage of `num_pages * page_size` token slots for every layer.

    Slot `page * page_size + i` holds position i of a page. Each layer's arrays are laid
    out (heads, slots, dim), so one broadcast index writes a (B, H, L, D) block in place
    (MLX donates the buffer) and one gather reads (B, H, Lk, D) contiguously, the layout
    attention wants.
    """

    def __init__(self, specs: List[LayerSpec], dtype: mx.Dtype, num_pages: int, page_size: int):
        self.specs = specs
        self.dtype = dtype
        self.page_size = page_size
        self.num_pages = num_pages
        n = num_pages * page_size
        self.keys = [mx.zeros((s.n_kv_heads, n, s.k_dim), dtype) for s in specs]
        self.values = [mx.zeros((s.n_kv_heads, n, s.v_dim), dtype) for s in specs]
        self._heads = {h: mx.arange(h)[None, :, None] for h in {s.n_kv_heads for s in specs}}
        # Evaluated now: a lazy array made on this thread can't be evaluated on the engine's.
        mx.eval(self.keys, self.values, list(self._heads.values()))

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.keys + self.values)

    def arrays(self) -> List[mx.array]:
        return self.keys + self.values

    def parts(self, layer: int):
        """The arrays that hold a layer's keys and those that hold its values."""
        return (self.keys[layer],), (self.values[layer],)

    def encode(self, x: mx.array) -> tuple:
        """K or V as the pool stores it: the parts `parts` has."""
        return (x,)

    def layer_bytes_per_token(self, layer: int) -> int:
        keys, values = self.parts(layer)
        return sum(a.nbytes for a in keys + values) // (self.num_pages * self.page_size)

    def write(self, layer: int, slots: mx.array, keys: mx.array, values: mx.array) -> None:
        """Store keys/values (B, H, L, D) at `slots` (B, 1, L)."""
        heads = self._heads[keys.shape[1]]
        self.keys[layer][heads, slots] = keys
        if values.shape[-1]:  # an index-key cache stores no values (MLX can't scatter empty rows)
            self.values[layer][heads, slots] = values

    def read(self, layer: int, table: mx.array):
        """K and V (B, H, Lk, D) of the slots in `table` (B, 1, Lk)."""
        heads = self._heads[self.keys[layer].shape[0]]
        keys = self.keys[layer][heads, table]
        if not self.specs[layer].v_dim:
            return keys, mx.zeros(keys.shape[:-1] + (0,), self.dtype)
        return keys, self.values[layer][heads, table]

"""The paged KV pool: one preallocated K and V array per attention layer."""

import os
from dataclasses import dataclass
from typing import List, Optional, Tuple

import mlx.core as mx
from mlx_lm.models import cache as mlx_cache


@dataclass(frozen=True)
class LayerSpec:
    n_kv_heads: int
    k_dim: int
    v_dim: int
    window: Optional[int] = None  # sliding-window size, None for full attention


def probe_layers(model) -> Tuple[List[LayerSpec], mx.Dtype]:
    """Each layer's KV shape, and the KV dtype, from one token through mlx-lm's caches."""
    caches = mlx_cache.make_prompt_cache(model)
    model(mx.array([[0]]), cache=caches)
    specs = []
    for c in caches:
        if not isinstance(c, (mlx_cache.KVCache, mlx_cache.RotatingKVCache)):
            raise NotImplementedError(
                f"{type(c).__name__} layers are not supported: macfarm pages KV attention only"
            )
        k, v = c.keys, c.values
        window = c.max_size if isinstance(c, mlx_cache.RotatingKVCache) else None
        specs.append(LayerSpec(k.shape[1], k.shape[3], v.shape[3], window))
    return specs, caches[0].keys.dtype


def kv_bytes_per_token(specs: List[LayerSpec], dtype: mx.Dtype) -> int:
    return sum(s.n_kv_heads * (s.k_dim + s.v_dim) for s in specs) * dtype.size


def device_memory() -> int:
    """Memory the device may use: Metal's working-set limit, else physical RAM."""
    info = mx.device_info() if hasattr(mx, "device_info") else {}
    if "max_recommended_working_set_size" in info:
        return int(info["max_recommended_working_set_size"])
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def pool_pages(
    specs: List[LayerSpec],
    dtype: mx.Dtype,
    page_size: int,
    weights_bytes: int,
    memory_fraction: float,
    max_total_tokens: Optional[int] = None,
) -> int:
    """Pages that fit `memory_fraction` of device memory left after the weights."""
    if max_total_tokens is not None:
        return max(1, max_total_tokens // page_size)
    budget = memory_fraction * max(0, device_memory() - weights_bytes)
    pages = int(budget // (kv_bytes_per_token(specs, dtype) * page_size))
    if pages < 1:
        raise ValueError("no memory left for the KV pool; lower the model size or set max_total_tokens")
    return pages


class KVPool:
    """K and V storage of `num_pages * page_size` token slots for every layer.

    Slot `page * page_size + i` holds position i of a page. Writes are in-place scatters
    (MLX donates the buffer), reads gather a batch's slots in position order.
    """

    def __init__(self, specs: List[LayerSpec], dtype: mx.Dtype, num_pages: int, page_size: int):
        self.specs = specs
        self.page_size = page_size
        self.num_pages = num_pages
        n = num_pages * page_size
        self.keys = [mx.zeros((n, s.n_kv_heads, s.k_dim), dtype) for s in specs]
        self.values = [mx.zeros((n, s.n_kv_heads, s.v_dim), dtype) for s in specs]
        mx.eval(self.keys, self.values)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.keys + self.values)

    def arrays(self) -> List[mx.array]:
        return self.keys + self.values

    def write(self, layer: int, slots: mx.array, keys: mx.array, values: mx.array) -> None:
        """keys/values: (B, H, L, D) for the slots (B * L,) in row-major order."""
        B, H, L, _ = keys.shape
        self.keys[layer][slots] = keys.swapaxes(1, 2).reshape(B * L, H, -1)
        self.values[layer][slots] = values.swapaxes(1, 2).reshape(B * L, H, -1)

    def read(self, layer: int, table: mx.array):
        """K and V of the slots in `table` (B, Lk), as (B, H, Lk, D)."""
        k = self.keys[layer][table].swapaxes(1, 2)
        v = self.values[layer][table].swapaxes(1, 2)
        return k, v

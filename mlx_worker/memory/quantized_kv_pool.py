"""KV pages stored quantized (`engine.kv_bits`): each layer's K and V as MLX's quantized
triplets (packed values, scales, biases), written with `mx.quantize` as mlx-lm's
`QuantizedKVCache` writes its own, and read by mlx-lm's attention with MLX's quantized
matmuls (a cache with `bits` and `group_size` selects them)."""

from typing import List, NamedTuple

import mlx.core as mx

from .kv_pool import KVPool
from .model_caches import LayerSpec


class KVQuantization(NamedTuple):
    bits: int
    group_size: int


def quantized_bytes_per_token(specs: List[LayerSpec], dtype: mx.Dtype, q: KVQuantization) -> int:
    """Packed values plus a scale and a bias (in the model's dtype) per group of a head."""
    def dim_bytes(d):
        return d * q.bits // 8 + 2 * (d // q.group_size) * dtype.size

    return sum(s.n_kv_heads * (dim_bytes(s.k_dim) + dim_bytes(s.v_dim)) for s in specs)


def check_quantizable(specs: List[LayerSpec], q: KVQuantization) -> None:
    for i, s in enumerate(specs):
        if not s.v_dim:
            raise ValueError(f"kv_bits: attention layer {i} stores keys only (an index cache), "
                             f"which quantized attention cannot read; set kv_bits null")
        if s.k_dim % q.group_size or s.v_dim % q.group_size:
            raise ValueError(f"kv_bits: the head dims of attention layer {i} ({s.k_dim}, {s.v_dim}) are not "
                             f"multiples of kv_group_size {q.group_size}; use a smaller kv_group_size")


class QuantizedKVPool(KVPool):
    """The paged pool with every slot quantized: `keys[layer]` and `values[layer]` are
    (packed, scales, biases), each laid out (heads, slots, ·) as the full-precision pool."""

    def __init__(self, specs: List[LayerSpec], dtype: mx.Dtype, num_pages: int, page_size: int,
                 quantization: KVQuantization):
        check_quantizable(specs, quantization)
        self.specs = specs
        self.dtype = dtype
        self.page_size = page_size
        self.num_pages = num_pages
        self.quantization = quantization
        n = num_pages * page_size
        bits, group = quantization

        def triplet(heads, dim):
            return (mx.zeros((heads, n, dim * bits // 32), mx.uint32),
                    mx.zeros((heads, n, dim // group), dtype), mx.zeros((heads, n, dim // group), dtype))

        self.keys = [triplet(s.n_kv_heads, s.k_dim) for s in specs]
        self.values = [triplet(s.n_kv_heads, s.v_dim) for s in specs]
        self._heads = {h: mx.arange(h)[None, :, None] for h in {s.n_kv_heads for s in specs}}
        mx.eval(self.arrays(), list(self._heads.values()))

    def arrays(self) -> List[mx.array]:
        return [a for triplet in self.keys + self.values for a in triplet]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays())

    def parts(self, layer: int):
        return self.keys[layer], self.values[layer]

    def encode(self, x: mx.array) -> tuple:
        bits, group = self.quantization
        return tuple(mx.quantize(x, group_size=group, bits=bits))

    def write(self, layer: int, slots: mx.array, keys: mx.array, values: mx.array) -> None:
        """Quantize keys/values (B, H, L, D) and store them at `slots` (B, 1, L)."""
        heads = self._heads[keys.shape[1]]
        for stored, new in ((self.keys[layer], keys), (self.values[layer], values)):
            for array, part in zip(stored, self.encode(new)):
                array[heads, slots] = part

    def read(self, layer: int, table: mx.array):
        """The quantized K and V triplets, each part (B, H, Lk, ·), of the slots in `table`."""
        heads = self._heads[self.keys[layer][0].shape[0]]
        return (tuple(a[heads, table] for a in self.keys[layer]),
                tuple(a[heads, table] for a in self.values[layer]))

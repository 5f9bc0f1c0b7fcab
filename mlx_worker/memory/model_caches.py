"""What a model keeps per layer, read from mlx-lm's own caches after one token.

Every mlx-lm cache kind maps onto one of two engine state kinds:
- attention KV (`KVCache`, `RotatingKVCache` = a sliding window, `ChunkedKVCache` =
  chunked attention, masked by the model itself): a layer of the paged pool (kv_pool.py);
- recurrent state (`ArraysCache`: conv and SSM / linear-attention state): a row of the
  state arrays each sequence carries (recurrent_state.py);
and `CacheList` composes several for one layer. `CacheTree.build` makes, for one forward,
the same nesting the model's `make_cache` returns, with the engine's caches as leaves.
"""

import math
from dataclasses import dataclass, field
from typing import Callable, List, Optional, Tuple

import mlx.core as mx
from mlx_lm.models import cache as mlx_cache


@dataclass(frozen=True)
class LayerSpec:
    """One attention layer's KV shape."""

    n_kv_heads: int
    k_dim: int
    v_dim: int
    window: Optional[int] = None  # sliding-window size, None for full (or chunked) attention


@dataclass(frozen=True)
class StateSpec:
    """One recurrent layer's state entries, per sequence (shape without the batch axis)."""

    shapes: Tuple[Tuple[int, ...], ...]
    dtypes: Tuple[mx.Dtype, ...]

    @property
    def nbytes(self) -> int:
        return sum(math.prod(shape) * dtype.size for shape, dtype in zip(self.shapes, self.dtypes))


@dataclass
class CacheTree:
    nodes: list  # per model cache entry: ("kv", i) | ("state", j) | ("list", [nodes]) | ("unused", None)
    kv: List[LayerSpec] = field(default_factory=list)
    states: List[StateSpec] = field(default_factory=list)
    kv_dtype: mx.Dtype = mx.float32
    vocab: int = 0

    @property
    def state_bytes(self) -> int:
        """Recurrent state of one sequence, all layers."""
        return sum(s.nbytes for s in self.states)

    def build(self, kv_cache: Callable[[int], object], state_cache: Callable[[int], object]) -> list:
        return [self._make(n, kv_cache, state_cache) for n in self.nodes]

    def _make(self, node, kv_cache, state_cache):
        # A method, not a nested function calling itself: that closure is a reference cycle,
        # and it kept each forward's caches (the staged decode KV among them: GBs) alive
        # until Python's cycle collector happened to run.
        kind, arg = node
        if kind == "kv":
            return kv_cache(arg)
        if kind == "state":
            return state_cache(arg)
        if kind == "unused":
            return mlx_cache.KVCache()
        return mlx_cache.CacheList(*(self._make(n, kv_cache, state_cache) for n in arg))


def probe_caches(model) -> CacheTree:
    """The model's cache layout, KV dtype and vocabulary size, from one token through
    mlx-lm's own caches."""
    caches = mlx_cache.make_prompt_cache(model)
    vocab = model(mx.array([[0]]), cache=caches).shape[-1]
    tree = CacheTree([], vocab=vocab)
    dtypes = []

    def visit(c):
        if isinstance(c, mlx_cache.CacheList):
            return ("list", [visit(x) for x in c.caches])
        if isinstance(c, mlx_cache.ArraysCache):
            arrays = [a for a in c.cache if a is not None]
            tree.states.append(StateSpec(tuple(a.shape[1:] for a in arrays), tuple(a.dtype for a in arrays)))
            return ("state", len(tree.states) - 1)
        if isinstance(c, (mlx_cache.KVCache, mlx_cache.RotatingKVCache, mlx_cache.ChunkedKVCache)):
            if c.keys is None:  # a layer that keeps nothing (e.g. attention replaced by a no-op)
                return ("unused", None)
            k, v = c.keys, c.values
            window = c.max_size if isinstance(c, mlx_cache.RotatingKVCache) else None
            tree.kv.append(LayerSpec(k.shape[1], k.shape[3], v.shape[3], window))
            dtypes.append(k.dtype)
            return ("kv", len(tree.kv) - 1)
        raise NotImplementedError(f"{type(c).__name__} layers are not supported yet")

    tree.nodes = [visit(c) for c in caches]
    if dtypes:
        tree.kv_dtype = dtypes[0]
    return tree

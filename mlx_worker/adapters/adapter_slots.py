"""Which LoRA adapters are resident on the model, in which slot: loaded on first use,
the least recently used one not in use unloaded when the slots are full."""

from collections import OrderedDict
from typing import Dict, Iterable, Optional

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_unflatten

from .adapter_files import Adapter, AdapterError, read_adapter
from .multi_lora import MultiLoRALinear, RowAdapters


def _linears(model: nn.Module) -> Dict[str, nn.Module]:
    return {p: m for p, m in model.named_modules() if isinstance(m, (nn.Linear, nn.QuantizedLinear))}


def _num_layers(model: nn.Module) -> int:
    layers = getattr(model, "layers", None)
    return len(layers) if layers is not None else 0


class AdapterSlots:
    """The adapters a model may serve (name -> directory), `capacity` resident at once.

    Every adapter is read and checked against the model at construction, so a wrong one
    fails the replica's start with its name; its weights are read again when it is
    loaded into a slot. The model's Linear layers that any adapter targets are wrapped
    (MultiLoRALinear), with a rank of the largest adapter's (smaller ones zero-padded).
    """

    def __init__(self, model: nn.Module, paths: Dict[str, str], capacity: int = 8):
        linears, depth = _linears(model), _num_layers(model)
        adapters = [read_adapter(name, path, linears, depth) for name, path in paths.items()]
        self.paths = dict(paths)
        self.dora = {a.name: a.dora for a in adapters}
        self.rank = max(a.rank for a in adapters)
        self.capacity = capacity
        self.rows = RowAdapters()
        targets = sorted({m for a in adapters for m in a.modules})
        self.layers = {p: MultiLoRALinear(linears[p], self.rows, capacity + 1, self.rank) for p in targets}
        model.update_modules(tree_unflatten(list(self.layers.items())))
        mx.eval([layer.parameters() for layer in self.layers.values()])  # here: MLX streams are per thread
        self._linears, self._depth = linears, depth
        self.slot_of: "OrderedDict[str, int]" = OrderedDict()  # resident adapters, least recently used first
        self.dora_slot = [False] * (capacity + 1)  # whether the adapter in each slot is DoRA
        self.num_loads = 0

    def __contains__(self, name: str) -> bool:
        return name in self.paths

    def acquire(self, name: str, busy: Iterable[int]) -> Optional[int]:
        """The slot of adapter `name`, loading it when it is not resident (into a free slot,
        or the least recently used one no sequence in `busy` uses: read only then); None:
        every slot is in use."""
        if name in self.slot_of:
            self.slot_of.move_to_end(name)
            return self.slot_of[name]
        used = set(self.slot_of.values())
        slot = next((s for s in range(1, self.capacity + 1) if s not in used), None)
        if slot is None:
            busy = set(busy)
            victim = next((n for n, s in self.slot_of.items() if s not in busy), None)
            if victim is None:
                return None
            slot = self.slot_of.pop(victim)
        self._load(read_adapter(name, self.paths[name], self._linears, self._depth), slot)
        self.slot_of[name] = slot
        self.dora_slot[slot] = self.dora[name]
        self.num_loads += 1
        return slot

    def select(self, slots) -> None:
        """The rows of the next forward (their adapter slots; 0: the base model)."""
        slots = list(slots)
        self.rows.select(slots, any(self.dora_slot[s] for s in slots))

    def _load(self, adapter: Adapter, slot: int) -> None:
        arrays = []
        for path, layer in self.layers.items():
            d = adapter.modules.get(path)
            a = mx.zeros(layer.lora_a.shape[1:], layer.lora_a.dtype)
            b = mx.zeros(layer.lora_b.shape[1:], layer.lora_b.dtype)
            norm_scale = mx.ones(layer.dora_scale.shape[1:], layer.dora_scale.dtype)
            scale = 0.0
            if d is not None:
                r = d.a.shape[1]
                a[:, :r] = d.a.astype(a.dtype)
                b[:r] = d.b.astype(b.dtype)
                scale = d.scale
                if adapter.dora:
                    norm_scale = _dora_scale(layer.linear, d).astype(norm_scale.dtype)
            layer.lora_a[slot] = a
            layer.lora_b[slot] = b
            layer.lora_scale[slot] = scale
            layer.dora_scale[slot] = norm_scale
            arrays += [layer.lora_a, layer.lora_b, layer.lora_scale, layer.dora_scale]
        mx.eval(arrays)

    def stats(self) -> dict:
        return {"resident": list(self.slot_of), "capacity": self.capacity, "loads": self.num_loads}


def _dora_scale(linear: nn.Module, d) -> mx.array:
    """m / |W + s B^T A^T| per output row, as mlx-lm's DoRALinear computes it."""
    w = linear.weight
    if isinstance(linear, nn.QuantizedLinear):
        w = mx.dequantize(w, linear.scales, linear.biases, group_size=linear.group_size, bits=linear.bits,
                          mode=linear.mode)
    m = d.magnitude if d.magnitude is not None else mx.linalg.norm(w.astype(mx.float32), axis=1)
    adapted = w + (d.scale * d.b.T.astype(w.dtype)) @ d.a.T.astype(w.dtype)
    return m / mx.linalg.norm(adapted, axis=1)


__all__ = ["AdapterError", "AdapterSlots"]

"""A linear layer that adds, for each row of a batch, the LoRA delta of that row's adapter.

It wraps a model's own Linear (or QuantizedLinear) in place, as mlx-lm's LoRALinear does,
so the model's class is used unmodified. Every resident adapter has a slot in the
stacked A [slots, in, r] and B [slots, r, out]; slot 0 is the base model (zeros). A
forward's rows name their slots in `RowAdapters.ids`, set by the engine before it calls
the model; the deltas are two gathered matmuls (`mx.gather_mm`), one forward for every
adapter of the batch. Rows of a forward with no adapter skip the delta altogether.
"""

from typing import List, Optional

import mlx.core as mx
import mlx.nn as nn

from .adapter_files import linear_dims


class RowAdapters:
    """The adapter slot of each row of the forward being built (None: all base)."""

    def __init__(self):
        self.ids: Optional[mx.array] = None
        self.dora = False  # some row's adapter is DoRA

    def select(self, slots: List[int], dora: bool) -> None:
        self.ids = mx.array(slots, dtype=mx.uint32) if any(slots) else None
        self.dora = dora


class MultiLoRALinear(nn.Module):
    def __init__(self, linear: nn.Module, rows: RowAdapters, slots: int, rank: int):
        super().__init__()
        self.linear = linear
        in_dims, out_dims = linear_dims(linear)
        dtype = linear.scales.dtype if isinstance(linear, nn.QuantizedLinear) else linear.weight.dtype
        self.lora_a = mx.zeros((slots, in_dims, rank), dtype)
        self.lora_b = mx.zeros((slots, rank, out_dims), dtype)
        self.lora_scale = mx.zeros((slots,), dtype)
        self.dora_scale = mx.ones((slots, out_dims), dtype)  # DoRA's m / |W + sBA| per output; 1 otherwise
        self.rows = rows

    def __call__(self, x: mx.array) -> mx.array:
        y = self.linear(x)
        ids = self.rows.ids
        if ids is None:
            return y
        if x.ndim != 3 or x.shape[0] != ids.size:
            raise ValueError(f"a LoRA layer got input of shape {x.shape} for {ids.size} rows")
        z = mx.gather_mm(mx.gather_mm(x, self.lora_a, rhs_indices=ids), self.lora_b, rhs_indices=ids)
        z = (self.lora_scale[ids][:, None, None] * z).astype(x.dtype)
        if not self.rows.dora:
            return y + z
        bias = self.linear.bias if "bias" in self.linear else None
        if bias is not None:
            y = y - bias
        y = self.dora_scale[ids][:, None, :].astype(x.dtype) * (y + z)
        return y if bias is None else y + bias

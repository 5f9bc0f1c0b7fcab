"""Load a model for the engine and pick its compute dtype for the device."""

from typing import Optional, Tuple

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm import load as mlx_load
from mlx_lm.utils import dequantize_model

from ..vision.vision_model import is_vision_checkpoint, load_vision_model
from .gguf import resolve_model

DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}


def on_metal() -> bool:
    return mx.metal.is_available()


def is_quantized(model: nn.Module) -> bool:
    return any(isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding)) for _, m in model.named_modules())


def apply_dtype(model: nn.Module, dtype: str = "auto") -> nn.Module:
    """'auto': keep the weights on Metal; on CPU dequantize to float32, where MLX's
    quantized kernels are slow and float32 matmuls run on BLAS. 'quantized' keeps
    the checkpoint as is; a float name dequantizes and casts."""
    if dtype == "auto":
        dtype = "quantized" if on_metal() else "float32"
    if dtype == "quantized":
        return model
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be auto, quantized or one of {sorted(DTYPES)}, got {dtype!r}")
    if is_quantized(model):
        model = dequantize_model(model)
    model.set_dtype(DTYPES[dtype])
    return model


def load_model(spec: Optional[str] = None, dtype: str = "auto") -> Tuple[nn.Module, object]:
    """(model, tokenizer) for a Hugging Face id, an mlx-lm directory, a .gguf file, or
    None for the embedded default model."""
    path = resolve_model(spec)
    if is_vision_checkpoint(path):
        model, tokenizer = load_vision_model(path)
    else:
        model, tokenizer = mlx_load(path)
    model = apply_dtype(model, dtype)
    mx.eval(model.parameters(), helper_arrays(model))
    return model, tokenizer


def helper_arrays(model: nn.Module) -> list:
    """Arrays a model keeps on plain helper objects, outside its parameters (Pixtral's
    rotary table): built lazily on the loading thread's stream, they must be evaluated
    there, as MLX refuses to run another thread's stream on the engine thread."""
    return [a for m in model.modules() for o in vars(m).values() if hasattr(o, "__dict__")
            and not isinstance(o, nn.Module) for a in vars(o).values() if isinstance(a, mx.array)]


def load_sharded(spec: Optional[str], dtype: str, group: mx.distributed.Group,
                 pipeline: bool = False) -> Tuple[nn.Module, object]:
    """(model, tokenizer) with only this rank's shard of the weights in memory: loaded
    lazily, cast, then split by mlx-lm's own `model.shard(group)` (tensor parallel: a
    slice of every layer) or `model.model.pipeline(group)` (a run of whole layers)."""
    model, tokenizer = mlx_load(resolve_model(spec), lazy=True)
    name = getattr(getattr(model, "args", None), "model_type", type(model).__module__)
    if pipeline and not hasattr(getattr(model, "model", None), "pipeline"):
        raise ValueError(f"{name} has no pipeline-parallel support in mlx-lm (no model.pipeline): "
                         f"use tensor_parallel_size, or 1")
    if not pipeline and not hasattr(model, "shard"):
        raise ValueError(f"{name} has no tensor-parallel support in mlx-lm (no Model.shard): "
                         f"use pipeline_parallel_size, or 1")
    model = apply_dtype(model, dtype)
    try:
        model.model.pipeline(group) if pipeline else model.shard(group)
    except Exception as e:  # noqa: BLE001 - e.g. heads that do not divide by the group size
        raise ValueError(f"{name} cannot be split over {group.size()} ranks: {e}") from e
    # One tensor at a time: each is read whole from the checkpoint, then sliced. Evaluated
    # together (as mlx-lm's sharded_load does), every whole tensor would be in memory at once.
    for _, w in tree_flatten(model.parameters()):
        mx.eval(w)
    return model, tokenizer

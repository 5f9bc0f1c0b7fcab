"""LoRA adapters on disk, in mlx-lm's format or PEFT's, read into one form.

mlx-lm: `adapter_config.json` ({fine_tune_type: lora|dora, num_layers, lora_parameters:
{rank, scale, ...}}) and `adapters.safetensors` (`<module>.lora_a` [in, r], `.lora_b`
[r, out], DoRA's `.m` [out]). PEFT: `adapter_config.json` ({r, lora_alpha,
target_modules, layers_to_transform, use_rslora, use_dora}) and
`adapter_model.safetensors` (`base_model.model.<module>.lora_A.weight` [r, in],
`.lora_B.weight` [out, r], DoRA's `.lora_magnitude_vector`). Either becomes an
`Adapter`: per module of the model, A [in, r], B [r, out], the scale and DoRA's
magnitude, checked against the model's own layers (a wrong adapter is an error that
names it, never a crash in a forward).
"""

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, Optional

import mlx.core as mx
import mlx.nn as nn

PEFT_PREFIX = "base_model.model."
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


class AdapterError(ValueError):
    """An adapter that cannot apply to this model (the message says why)."""


@dataclass
class ModuleDelta:
    a: mx.array  # [in, r]
    b: mx.array  # [r, out]
    scale: float
    magnitude: Optional[mx.array] = None  # DoRA's m [out]


@dataclass
class Adapter:
    name: str
    path: Path
    dora: bool
    rank: int
    modules: Dict[str, ModuleDelta] = field(default_factory=dict)


def linear_dims(layer: nn.Module):
    """(in, out) of a Linear or QuantizedLinear."""
    out_dims, in_dims = layer.weight.shape
    if isinstance(layer, nn.QuantizedLinear):
        in_dims = in_dims * 32 // layer.bits
    return in_dims, out_dims


def read_adapter(name: str, path, linears: Dict[str, nn.Module], num_layers: int) -> Adapter:
    """The adapter at `path`, validated against `linears` (the model's Linear modules by
    path) in a model of `num_layers` blocks."""
    path = Path(path)
    cfg_file = path / "adapter_config.json"
    if not cfg_file.is_file():
        raise AdapterError(f"adapter {name!r}: no adapter_config.json in {path}")
    try:
        cfg = json.loads(cfg_file.read_text())
    except ValueError as e:
        raise AdapterError(f"adapter {name!r}: {cfg_file} is not JSON: {e}") from None
    if (path / "adapters.safetensors").is_file():
        adapter = _read_mlx_lm(name, path, cfg, num_layers)
    elif (path / "adapter_model.safetensors").is_file():
        adapter = _read_peft(name, path, cfg)
    else:
        raise AdapterError(f"adapter {name!r}: {path} has neither adapters.safetensors (mlx-lm) "
                           f"nor adapter_model.safetensors (PEFT)")
    _check(adapter, linears)
    return adapter


def _load(name: str, file: Path) -> Dict[str, mx.array]:
    try:
        return mx.load(str(file))
    except Exception as e:  # noqa: BLE001 - a truncated or foreign file
        raise AdapterError(f"adapter {name!r}: cannot read {file}: {e}") from None


def _read_mlx_lm(name: str, path: Path, cfg: dict, num_layers: int) -> Adapter:
    kind = cfg.get("fine_tune_type", "lora")
    if kind not in ("lora", "dora"):
        raise AdapterError(f"adapter {name!r}: fine_tune_type {kind!r} is not an adapter (lora or dora)")
    params = cfg.get("lora_parameters") or {}
    if "scale" not in params or "rank" not in params:
        raise AdapterError(f"adapter {name!r}: lora_parameters needs rank and scale (mlx-lm's format)")
    first = num_layers - max(int(cfg.get("num_layers", num_layers)), 0)
    weights = _load(name, path / "adapters.safetensors")
    modules: Dict[str, ModuleDelta] = {}
    for key in weights:
        module, leaf = key.rsplit(".", 1)
        if leaf not in ("lora_a", "lora_b", "m"):
            raise AdapterError(f"adapter {name!r}: {key} is not an adapter weight (lora_a, lora_b or m)")
        layer = _LAYER.search(module)
        if layer and int(layer.group(1)) < first:
            raise AdapterError(f"adapter {name!r}: {key} is in layer {layer.group(1)}, below its "
                               f"num_layers {cfg.get('num_layers')} of {num_layers}")
        if module not in modules:
            a, b = weights.get(module + ".lora_a"), weights.get(module + ".lora_b")
            if a is None or b is None:
                raise AdapterError(f"adapter {name!r}: {module} needs both lora_a and lora_b")
            modules[module] = ModuleDelta(a, b, float(params["scale"]), weights.get(module + ".m"))
    return Adapter(name, path, kind == "dora", int(params["rank"]), modules)


def _peft_targeted(cfg: dict, module: str) -> bool:
    """PEFT's own rule: `target_modules` a regex (full match) or names a module ends with;
    `layers_to_transform` the block indices."""
    targets = cfg.get("target_modules")
    if isinstance(targets, str):
        ok = re.fullmatch(targets, module) is not None
    else:
        ok = any(module == t or module.endswith("." + t) for t in targets or ())
    layers = cfg.get("layers_to_transform")
    if ok and layers is not None:
        layer = _LAYER.search(module)
        ok = layer is not None and int(layer.group(1)) in ([layers] if isinstance(layers, int) else layers)
    return ok


def _read_peft(name: str, path: Path, cfg: dict) -> Adapter:
    if cfg.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"adapter {name!r}: peft_type {cfg.get('peft_type')!r} is not LoRA")
    if cfg.get("rank_pattern") or cfg.get("alpha_pattern"):
        raise AdapterError(f"adapter {name!r}: rank_pattern and alpha_pattern are not supported")
    if cfg.get("fan_in_fan_out"):
        raise AdapterError(f"adapter {name!r}: fan_in_fan_out (Conv1D layers) is not supported")
    r, alpha = int(cfg.get("r", 8)), float(cfg.get("lora_alpha", 8))
    scale = alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r
    weights = _load(name, path / "adapter_model.safetensors")
    grouped: Dict[str, Dict[str, mx.array]] = {}
    for key, w in weights.items():
        body = key[len(PEFT_PREFIX):] if key.startswith(PEFT_PREFIX) else key
        for leaf in ("lora_A.weight", "lora_B.weight", "lora_magnitude_vector.weight", "lora_magnitude_vector"):
            if body.endswith("." + leaf):
                grouped.setdefault(body[: -len(leaf) - 1], {})[leaf.split(".")[0]] = w
                break
        else:
            raise AdapterError(f"adapter {name!r}: {key} is not a LoRA weight (modules_to_save and "
                               f"trained biases are not adapters)")
    modules = {}
    for module, parts in grouped.items():
        if not _peft_targeted(cfg, module):
            raise AdapterError(f"adapter {name!r}: {module} is outside its target_modules / layers_to_transform")
        if "lora_A" not in parts or "lora_B" not in parts:
            raise AdapterError(f"adapter {name!r}: {module} needs both lora_A and lora_B")
        modules[module] = ModuleDelta(parts["lora_A"].T, parts["lora_B"].T, scale, parts.get("lora_magnitude_vector"))
    return Adapter(name, path, bool(cfg.get("use_dora")), r, modules)


def _check(adapter: Adapter, linears: Dict[str, nn.Module]) -> None:
    if not adapter.modules:
        raise AdapterError(f"adapter {adapter.name!r}: no LoRA weights")
    for module, d in adapter.modules.items():
        layer = linears.get(module)
        if layer is None:
            raise AdapterError(f"adapter {adapter.name!r}: the model has no linear layer {module!r} (adapters "
                               f"apply to Linear and QuantizedLinear layers, not embeddings or MoE experts)")
        in_dims, out_dims = linear_dims(layer)
        if d.a.ndim != 2 or d.b.ndim != 2 or d.a.shape[0] != in_dims or d.b.shape[1] != out_dims \
                or d.a.shape[1] != d.b.shape[0]:
            raise AdapterError(f"adapter {adapter.name!r}: {module} has A {tuple(d.a.shape)} and B "
                               f"{tuple(d.b.shape)}; the layer takes {in_dims} and gives {out_dims}")
        if d.magnitude is not None and d.magnitude.shape != (out_dims,):
            raise AdapterError(f"adapter {adapter.name!r}: {module} has a DoRA magnitude of shape "
                               f"{tuple(d.magnitude.shape)}, not ({out_dims},)")
    adapter.rank = max(d.a.shape[1] for d in adapter.modules.values())

"""Where a model's replicas fit: each declares the memory it will use (weights, KV pool,
its decode staging) as the `mac_memory_gb` resource every Mac of the farm has (its
unified memory, cluster.yaml), so Ray packs several small models on one Mac, gives a
big one a Mac of its own, and an app whose model fits on no Mac is refused at deploy
with a message that says so. Without that resource (one box) nothing is declared, and a
model bigger than this machine is refused the same way."""

import json
import logging
import math
from pathlib import Path
from typing import List, Optional

from mlx_worker.config import EngineConfig
from mlx_worker.memory.kv_pool import device_memory
from mlx_worker.models.gguf import resolve_model
from mlx_worker.models.loader import on_metal

logger = logging.getLogger("ray.serve")

MEMORY_RESOURCE = "mac_memory_gb"
MARGIN = 1.1  # activations and the allocator's slack over weights + KV


def _local(model: Optional[str]) -> Optional[Path]:
    """The model's files here: a directory or .gguf file, or an HF id already in the local
    cache; None: not downloaded here (unknown until a replica loads it)."""
    spec = resolve_model(model)
    if Path(spec).exists():
        return Path(spec)
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(spec, local_files_only=True))
    except Exception:  # noqa: BLE001 - any failure means: not here
        return None


def weights_bytes(path: Path, config: dict, dtype: str = "auto") -> Optional[int]:
    """The bytes a model's weights take once loaded with `dtype`, from its files and its
    config.json; None: no weights files."""
    if path.is_file():
        return path.stat().st_size
    size = sum(f.stat().st_size for f in path.glob("*.safetensors"))
    if not size:
        return None
    if dtype == "quantized" or (dtype == "auto" and on_metal()):
        return size
    bits = (config.get("quantization") or {}).get("bits")
    stored = bits / 8 if bits else 4 if config.get("torch_dtype") == "float32" else 2
    loaded = 2 if dtype in ("float16", "bfloat16") else 4  # auto on a CPU: float32
    return int(size * loaded / stored)


def _config(path: Path) -> dict:
    try:
        return {} if path.is_file() else json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return {}


def config_kv_bytes_per_token(config: dict, kv_bits: Optional[int] = None, kv_group_size: int = 64) -> Optional[int]:
    """K and V bytes of one token in every layer, from a model's config.json, before it is
    loaded (memory/kv_pool.kv_bytes_per_token counts them from the loaded model's layers);
    float32 (a CPU's) or the checkpoint's float16 on Metal: the larger. Quantized
    (kv_bits): packed values plus a float32 scale and bias a group."""
    config = {**config, **config.get("text_config", {})}
    heads = config.get("num_attention_heads")
    layers, kv_heads = config.get("num_hidden_layers"), config.get("num_key_value_heads", heads)
    hidden = config.get("hidden_size")
    head_dim = config.get("head_dim") or (hidden // heads if heads and hidden else None)
    if not (layers and kv_heads and head_dim):
        return None
    element = 4 if kv_bits is None else kv_bits / 8 + 2 * 4 / kv_group_size
    return int(2 * layers * kv_heads * head_dim * element)


def replica_memory_bytes(model: Optional[str], engine: dict, mac_memory: int) -> Optional[int]:
    """What one replica of `model` will hold on a Mac of `mac_memory` bytes: its weights,
    its KV pool (max_total_tokens, else kv_memory_fraction of what the weights leave), the
    decode batch's staged copy of it and (a vision model) its image cache; None: the
    weights' size is unknown here."""
    cfg = EngineConfig.model_validate({**engine, "model": model})
    path = _local(model)
    if path is None:
        return None
    config = _config(path)
    weights = weights_bytes(path, config, cfg.dtype)
    if weights is None:
        return None
    per_token = config_kv_bytes_per_token(config, cfg.kv_bits, cfg.kv_group_size) if cfg.max_total_tokens else None
    spec = cfg.speculative
    draft = _local(spec.draft_model) if spec is not None and spec.draft_model else None
    if draft is not None:  # a draft model: its weights, and its KV beside every token's
        weights += weights_bytes(draft, _config(draft), cfg.dtype) or 0
        per_token = per_token and per_token + (config_kv_bytes_per_token(_config(draft)) or 0)
    if per_token:
        kv = cfg.max_total_tokens * per_token
    else:
        kv = cfg.kv_memory_fraction * max(0, mac_memory - weights)
    images = cfg.image_cache_bytes if "vision_config" in config else 0
    return int(MARGIN * (weights + kv * (1 + cfg.decode_staging_fraction) + images))


def check_fits(name: str, need: int, largest: int) -> None:
    """Refuse (ValueError) a model whose replica needs more memory than the largest Mac has."""
    if need > largest:
        raise ValueError(f"model {name!r} does not fit the farm: one replica needs about {need / 2**30:.1f} GiB "
                         f"(weights, KV pool and its staging), and the largest Mac has {largest / 2**30:.1f} GiB; "
                         f"lower its kv_memory_fraction or max_total_tokens, use a quantized checkpoint, or span "
                         f"Macs (tensor_parallel_size)")


def replica_memory(name: str, model: Optional[str], engine: dict, macs: List[dict]) -> Optional[float]:
    """The `mac_memory_gb` one replica of `model` declares, given the Macs' resources
    (`ray.nodes()`); None: nothing to declare (no Mac has the resource, or the weights are
    unknown here). A model that fits no Mac (or not this machine) raises ValueError."""
    sizes = [r[MEMORY_RESOURCE] for r in macs if r.get(MEMORY_RESOURCE)]
    largest = int(max(sizes) * 2**30) if sizes else device_memory()
    need = replica_memory_bytes(model, engine, largest)
    if need is None:
        if sizes:
            log_unknown(name)
        return None
    check_fits(name, need, largest)
    return math.ceil(100 * need / 2**30) / 100 if sizes else None


def log_unknown(name: str) -> None:
    logger.warning(f"model {name!r}: its weights are not on this machine, so its replicas declare no "
                   f"{MEMORY_RESOURCE}; Ray places them by the `mac` resource alone")

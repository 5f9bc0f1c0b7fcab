"""The multi-token-prediction head some checkpoints ship, which mlx-lm drops when it
loads them: read back from the checkpoint's files into a module built from mlx-lm's own
decoder layer class. One file per form: `mtp_qwen.py` (Qwen3-Next, Qwen3.5 and its
MoE: `mtp.*`), `mtp_deepseek.py` (DeepSeek-V3, GLM-4 MoE: the layer after the last).
A head maps (embeddings of tokens i + 1, the target's final hidden states at i) to its
own hidden states (`__call__`, which the next draft takes in) and those to logits
(`logits`); `mtp_drafter.py` runs it in the engine.
"""

import json
from pathlib import Path
from typing import Optional

import mlx.core as mx
from mlx.utils import tree_flatten

from . import mtp_deepseek, mtp_qwen

HEADS = {**{t: mtp_qwen.QwenMTPHead for t in mtp_qwen.TYPES},
         **{t: mtp_deepseek.DeepSeekMTPHead for t in mtp_deepseek.TYPES}}


def checkpoint_files(spec: Optional[str]) -> Path:
    from mlx_lm.utils import _download

    from ..models.gguf import resolve_model

    return _download(resolve_model(spec))


def load_mtp_head(model, path: Path):
    """The MTP head of the checkpoint at `path` for `model` (loaded from it), or a
    ValueError that says why there is none."""
    model_type = getattr(getattr(model, "args", None), "model_type", type(model).__module__)
    if model_type not in HEADS:
        raise ValueError(f"speculative method 'mtp' is built for {', '.join(HEADS)}, not {model_type}")
    head_class = HEADS[model_type]
    config = json.loads((path / "config.json").read_text()) if (path / "config.json").exists() else {}
    config = {**config, **config.get("text_config", {})}
    num_layers = head_class.num_layers(config)
    weights, raw = _tensors(path, head_class.prefix(config)) if num_layers else ({}, True)
    if not weights:
        raise ValueError(f"{path} has no MTP weights ({head_class.prefix(config)}* tensors and a layer count "
                         f"in config.json); converted checkpoints often drop them: use the original one")
    head = head_class(model, num_layers)
    head.load_weights(list(head_class.sanitize(model, weights, raw).items()))
    head.set_dtype(next(v.dtype for _, v in tree_flatten(model.parameters()) if mx.issubdtype(v.dtype, mx.floating)))
    mx.eval(head.parameters())
    return head


def _tensors(path: Path, prefix: str):
    """The checkpoint's tensors under `prefix`, without it (only the shards that hold them
    are read), and whether they are as Hugging Face wrote them (not MLX's format)."""
    index = path / "model.safetensors.index.json"
    if index.exists():
        shards = {f for k, f in json.loads(index.read_text())["weight_map"].items() if k.startswith(prefix)}
        files = [path / f for f in sorted(shards)]
    else:
        files = sorted(path.glob("*.safetensors"))
    weights, raw = {}, True
    for f in files:
        tensors, metadata = mx.load(str(f), return_metadata=True)
        found = {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}
        if found:
            weights.update(found)
            raw = raw and (metadata or {}).get("format") != "mlx"
    return weights, raw

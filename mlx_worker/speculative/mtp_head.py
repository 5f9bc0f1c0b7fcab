"""The multi-token-prediction head some checkpoints ship (Qwen3-Next, Qwen3.5 and its MoE): mlx-lm
drops its `mtp.*` weights when it loads them; here they are read back from the
checkpoint's files into a module built from mlx-lm's own decoder layer class.

At position i the head takes the embedding of token i + 1 and the target's final
hidden state at i (after the model's final norm, as vLLM and mlx-vlm feed it) and
predicts token i + 2:

    h = fc([pre_fc_norm_embedding(embed(t[i+1])), pre_fc_norm_hidden(hidden[i])])
    h = layers(h)  # full-attention decoder layers of the model's own class, with a KV cache
    logits = lm_head(norm(h))  # the target's output head
"""

import json
from pathlib import Path
from typing import Optional, Tuple

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.models.base import create_attention_mask

LAYER_COUNT_KEYS = ("mtp_num_hidden_layers", "num_nextn_predict_layers")
SUPPORTED = ("qwen3_next", "qwen3_5", "qwen3_5_moe")
NORMS = ("input_layernorm.weight", "post_attention_layernorm.weight", "q_norm.weight", "k_norm.weight",
         "pre_fc_norm_embedding.weight", "pre_fc_norm_hidden.weight", "norm.weight")


def text_model(model):
    """(the decoder body with `layers` and `embed_tokens`, its ModelArgs); Qwen3.5 keeps
    them in a `language_model`."""
    holder = getattr(model, "language_model", model)
    return holder.model, holder.args


class MTPHead(nn.Module):
    def __init__(self, model, num_layers: int):
        super().__init__()
        body, args = text_model(model)
        H, eps = args.hidden_size, args.rms_norm_eps
        full = args.full_attention_interval - 1  # a layer index whose layer is full attention
        layer_class = type(body.layers[full])
        self.fc = nn.Linear(2 * H, H, bias=False)
        self.pre_fc_norm_embedding = nn.RMSNorm(H, eps=eps)
        self.pre_fc_norm_hidden = nn.RMSNorm(H, eps=eps)
        self.layers = [layer_class(args, layer_idx=full) for _ in range(num_layers)]
        self.norm = nn.RMSNorm(H, eps=eps)

    def __call__(self, embeddings: mx.array, hidden: mx.array, caches) -> mx.array:
        """(B, L, H) embeddings of tokens i + 1 and hidden states at i: the head's hidden
        states (before the output head)."""
        h = mx.concatenate([self.pre_fc_norm_embedding(embeddings), self.pre_fc_norm_hidden(hidden)], axis=-1)
        h = self.fc(h)
        mask = create_attention_mask(h, caches[0])
        for layer, cache in zip(self.layers, caches):
            h = layer(h, mask, cache)
        return self.norm(h)


def checkpoint_files(spec: Optional[str]) -> Path:
    from mlx_lm.utils import _download

    from ..models.gguf import resolve_model

    return _download(resolve_model(spec))


def load_mtp_head(model, path: Path) -> MTPHead:
    """The MTP head of the checkpoint at `path` for `model` (loaded from it), or a
    ValueError that says why there is none."""
    model_type = getattr(getattr(model, "args", None), "model_type", type(model).__module__)
    if model_type not in SUPPORTED:
        raise ValueError(f"speculative method 'mtp' is built for {', '.join(SUPPORTED)}, not {model_type}")
    config = json.loads((path / "config.json").read_text()) if (path / "config.json").exists() else {}
    config = {**config, **config.get("text_config", {})}
    num_layers = next((config[k] for k in LAYER_COUNT_KEYS if config.get(k)), 0)
    weights, raw = _mtp_weights(path)
    if not num_layers or not weights:
        raise ValueError(f"{path} has no MTP weights (mtp.* tensors and {' or '.join(LAYER_COUNT_KEYS)} "
                         f"in config.json); converted checkpoints often drop them: use the original one")
    head = MTPHead(model, num_layers)
    head.load_weights(list(_sanitize(model, weights, raw).items()))
    head.set_dtype(next(v.dtype for _, v in tree_flatten(model.parameters()) if mx.issubdtype(v.dtype, mx.floating)))
    mx.eval(head.parameters())
    return head


def _mtp_weights(path: Path) -> Tuple[dict, bool]:
    """The checkpoint's `mtp.*` tensors, without the prefix (only the shards that hold
    them are read), and whether they are as Hugging Face wrote them (not MLX's format)."""
    index = path / "model.safetensors.index.json"
    if index.exists():
        shards = {f for k, f in json.loads(index.read_text())["weight_map"].items() if k.startswith("mtp.")}
        files = [path / f for f in sorted(shards)]
    else:
        files = sorted(path.glob("*.safetensors"))
    weights, raw = {}, True
    for f in files:
        tensors, metadata = mx.load(str(f), return_metadata=True)
        mtp = {k[4:]: v for k, v in tensors.items() if k.startswith("mtp.")}
        if mtp:
            weights.update(mtp)
            raw = raw and (metadata or {}).get("format") != "mlx"
    return weights, raw


def _sanitize(model, weights: dict, raw: bool) -> dict:
    """A Hugging Face checkpoint's MTP tensors as mlx-lm's classes name them: experts
    stacked (or split) by the model's own sanitize, under its layer names, and zero-centred
    norm weights shifted by one as mlx-lm shifts the model's."""
    out = {k: v + 1.0 if raw and v.ndim == 1 and k.endswith(NORMS) else v for k, v in weights.items()
           if ".mlp.experts." not in k}
    experts = {f"model.{k}": v for k, v in weights.items() if ".mlp.experts." in k}
    if experts:
        out.update({k[k.index("layers."):]: v for k, v in model.sanitize(experts).items()})
    return out

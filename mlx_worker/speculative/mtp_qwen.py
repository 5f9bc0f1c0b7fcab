"""Qwen3-Next and Qwen3.5's MTP head (`mtp.*` tensors).

At position i it takes the embedding of token i + 1 and the target's final hidden state
at i (after the model's final norm, as vLLM and mlx-vlm feed it) and predicts token i + 2:

    h = fc([pre_fc_norm_embedding(embed(t[i+1])), pre_fc_norm_hidden(hidden[i])])
    h = norm(layers(h))  # full-attention decoder layers of the model's own class
    logits = lm_head(h)  # the target's output head; h also feeds the next draft
"""

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_attention_mask

TYPES = ("qwen3_next", "qwen3_5", "qwen3_5_moe")
LAYER_COUNT_KEYS = ("mtp_num_hidden_layers", "num_nextn_predict_layers")
NORMS = ("input_layernorm.weight", "post_attention_layernorm.weight", "q_norm.weight", "k_norm.weight",
         "pre_fc_norm_embedding.weight", "pre_fc_norm_hidden.weight", "norm.weight")


def text_model(model):
    """(the decoder body with `layers` and `embed_tokens`, its ModelArgs); Qwen3.5 keeps
    them in a `language_model`."""
    holder = getattr(model, "language_model", model)
    return holder.model, holder.args


class QwenMTPHead(nn.Module):
    zero_first_position = False

    def __init__(self, model, num_layers: int):
        super().__init__()
        body, args = text_model(model)
        H, eps = args.hidden_size, args.rms_norm_eps
        full = args.full_attention_interval - 1  # a layer index whose layer is full attention
        self.fc = nn.Linear(2 * H, H, bias=False)
        self.pre_fc_norm_embedding = nn.RMSNorm(H, eps=eps)
        self.pre_fc_norm_hidden = nn.RMSNorm(H, eps=eps)
        layer_class = type(next(layer for layer in body.layers if layer is not None))  # a pipeline stage holds some
        self.layers = [layer_class(args, layer_idx=full) for _ in range(num_layers)]
        self.norm = nn.RMSNorm(H, eps=eps)

    def __call__(self, embeddings: mx.array, hidden: mx.array, caches) -> mx.array:
        """(B, L, H) embeddings of tokens i + 1 and hidden states at i: the head's hidden
        states, which the next draft takes in."""
        h = self.fc(mx.concatenate([self.pre_fc_norm_embedding(embeddings), self.pre_fc_norm_hidden(hidden)],
                                   axis=-1))
        mask = create_attention_mask(h, caches[0])
        for layer, cache in zip(self.layers, caches):
            h = layer(h, mask, cache)
        return self.norm(h)

    def logits(self, h: mx.array, output_head) -> mx.array:
        return output_head(h)

    @staticmethod
    def num_layers(config: dict) -> int:
        return next((config[k] for k in LAYER_COUNT_KEYS if config.get(k)), 0)

    @staticmethod
    def prefix(config: dict) -> str:
        return "mtp."

    @staticmethod
    def sanitize(model, weights: dict, raw: bool) -> dict:
        """A Hugging Face checkpoint's MTP tensors as mlx-lm's classes name them: experts
        stacked (or split) by the model's own sanitize, under its layer names, and
        zero-centred norm weights shifted by one as mlx-lm shifts the model's."""
        out = {k: v + 1.0 if raw and v.ndim == 1 and k.endswith(NORMS) else v for k, v in weights.items()
               if ".mlp.experts." not in k}
        experts = {f"model.{k}": v for k, v in weights.items() if ".mlp.experts." in k}
        if experts:
            out.update({k[k.index("layers."):]: v for k, v in model.sanitize(experts).items()})
        return out

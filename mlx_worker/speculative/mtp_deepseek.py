"""DeepSeek-V3 and GLM-4 MoE's MTP layer (`model.layers.{num_hidden_layers}.*`, the layer
after the last; mlx-lm's sanitize drops it).

At position i it takes the embedding of token i + 1 (zero at position 0, as vLLM does)
and the target's final hidden state at i, and predicts token i + 2:

    h = layer(eh_proj([enorm(embed(t[i+1])), hnorm(hidden[i])]))  # a decoder layer of the model's class
    logits = lm_head(shared_head.norm(h))

The checkpoint's own copies of the embedding and the output head (`embed_tokens`,
`shared_head.head`) are the target's (DeepSeek-V3 shares them): the target's are used.
"""

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_attention_mask

TYPES = ("deepseek_v3", "glm4_moe")


class SharedHead(nn.Module):
    def __init__(self, H: int, eps: float):
        super().__init__()
        self.norm = nn.RMSNorm(H, eps=eps)


class DeepSeekMTPHead(nn.Module):
    zero_first_position = True

    def __init__(self, model, num_layers: int):
        super().__init__()
        args = model.args
        H, eps = args.hidden_size, args.rms_norm_eps
        self.enorm = nn.RMSNorm(H, eps=eps)
        self.hnorm = nn.RMSNorm(H, eps=eps)
        self.eh_proj = nn.Linear(2 * H, H, bias=False)
        self.layers = [type(model.model.layers[-1])(args, args.num_hidden_layers)]  # the first MTP layer only
        self.shared_head = SharedHead(H, eps)

    def __call__(self, embeddings: mx.array, hidden: mx.array, caches) -> mx.array:
        h = self.eh_proj(mx.concatenate([self.enorm(embeddings), self.hnorm(hidden)], axis=-1))
        return self.layers[0](h, create_attention_mask(h, caches[0], return_array=True), caches[0])

    def logits(self, h: mx.array, output_head) -> mx.array:
        return output_head(self.shared_head.norm(h))

    @staticmethod
    def num_layers(config: dict) -> int:
        return config.get("num_nextn_predict_layers") or 0

    @staticmethod
    def prefix(config: dict) -> str:
        return f"model.layers.{config['num_hidden_layers']}."

    @staticmethod
    def sanitize(model, weights: dict, raw: bool) -> dict:
        """The layer's tensors as mlx-lm's classes name them: its decoder layer's through the
        model's own sanitize (fp8 dequantized, experts stacked, MLA's kv_b_proj split),
        under the name of the model's last layer (of the same kind)."""
        own = ("enorm.", "hnorm.", "eh_proj.", "shared_head.norm.")
        shared = ("embed_tokens.", "shared_head.head.")
        last = f"model.layers.{len(model.model.layers) - 1}."
        layer = {last + k: v for k, v in weights.items() if not k.startswith(own + shared)}
        out = {f"layers.0.{k[len(last):]}": v for k, v in model.sanitize(layer).items() if k.startswith(last)}
        out.update({k: v for k, v in weights.items() if k.startswith(own)})
        return out

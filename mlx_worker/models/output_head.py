"""The model split into its transformer body and output head, so a prefill computes
logits only at the positions that are sampled (one row of a 2,048-token chunk, not all
2,048 x vocab)."""

from typing import Callable, Optional, Tuple

import mlx.core as mx

Body = Callable[..., mx.array]
Head = Callable[[mx.array], mx.array]


def split_output_head(model) -> Optional[Tuple[Body, Head]]:
    """(body, head) with `head(body(x, cache=c)) == model(x, cache=c)`, or None.

    mlx-lm's decoder models end `out = self.model(inputs, cache); return lm_head(out)`
    (or `embed_tokens.as_linear` when tied), some inside a `language_model`. Whether this model does is checked once on
    a probe input, so a model with anything else after its body keeps the full call.
    """
    holder = getattr(model, "language_model", model)  # a text model inside a multimodal one (Qwen3.5)
    body = getattr(holder, "model", None)
    if body is None:
        return None
    if "lm_head" in holder:
        head = holder.lm_head
    elif hasattr(body, "embed_tokens") and hasattr(body.embed_tokens, "as_linear"):
        head = body.embed_tokens.as_linear
    else:
        return None
    probe = mx.array([[1, 2, 3]])
    try:
        split = head(body(probe, cache=None))
        full = model(probe, cache=None)
        same = split.shape == full.shape and mx.allclose(split, full, rtol=0, atol=0).item()
    except Exception:  # noqa: BLE001 - a body with another signature: keep the full call
        return None
    return (lambda x, cache: body(x, cache=cache), head) if same else None

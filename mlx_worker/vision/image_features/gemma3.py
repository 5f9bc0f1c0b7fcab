"""Gemma 3: the SigLIP tower's last hidden state through the projector, (tokens, hidden) an
image; a prompt's images stacked (images, tokens, hidden). Every image has the tower's
size, so those of several prompts stack into one call (`gather`)."""

from typing import Dict, List, Tuple

import mlx.core as mx


def encode(vlm, arrays: Dict[str, mx.array], which: List[int]) -> List[mx.array]:
    pixels = arrays["pixel_values"][mx.array(which)]
    dtype = vlm.language_model.model.embed_tokens.weight.dtype
    hidden, _, _ = vlm.vision_tower(pixels.transpose(0, 2, 3, 1).astype(dtype), output_hidden_states=True)
    features = vlm.multi_modal_projector(hidden)
    return [features[i] for i in range(len(which))]


def join(features: List[mx.array]) -> mx.array:
    return mx.stack(features)


def gather(parts: List[Tuple[Dict[str, mx.array], List[int]]]) -> Dict[str, mx.array]:
    """The arrays of the images `which` of each (arrays, which), as one prompt's."""
    return {"pixel_values": mx.concatenate([arrays["pixel_values"][mx.array(which)] for arrays, which in parts])}

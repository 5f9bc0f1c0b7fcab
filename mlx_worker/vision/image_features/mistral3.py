"""Mistral 3: the Pixtral tower's patches of each image (its own size, `image_sizes`),
merged 2 x 2 by the projector, (rows * cols, hidden) an image; a prompt's images one
after another; several prompts' images in one call of the tower (Pixtral's `gather`)."""

from typing import Dict, List

import mlx.core as mx
import numpy as np

from . import split
from .pixtral import gather  # noqa: F401


def encode(vlm, arrays: Dict[str, mx.array], which: List[int]) -> List[mx.array]:
    """The images `which` in one call of the tower (all of a prompt's: as mlx-vlm calls it)."""
    sizes = arrays["image_sizes"][mx.array(which)]
    pixels = arrays["pixel_values"][mx.array(which)].transpose(0, 2, 3, 1)
    *_, hidden = vlm.vision_tower(pixels, output_hidden_states=True, image_sizes=sizes)
    selected = hidden[vlm.vision_feature_layer]
    if selected.ndim == 3 and selected.shape[0] == 1:
        selected = selected.squeeze(0)
    features = vlm.multi_modal_projector(selected, sizes)
    cell = vlm.config.vision_config.patch_size * vlm.config.spatial_merge_size
    counts = [(int(h) // cell) * (int(w) // cell) for h, w in np.array(sizes)]
    return split(features, counts)


def join(features: List[mx.array]) -> mx.array:
    return mx.concatenate(features)

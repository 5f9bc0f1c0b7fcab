"""Pixtral: the tower's patches of each image (its own size, `image_sizes`) through the
projector, (rows * cols, hidden) an image; a prompt's images one after another; several
prompts' images in one call of the tower (`gather`)."""

from typing import Dict, List, Tuple

import mlx.core as mx
import numpy as np

from . import split


def encode(vlm, arrays: Dict[str, mx.array], which: List[int]) -> List[mx.array]:
    """The images `which` in one call of the tower (all of a prompt's: as mlx-vlm calls it)."""
    sizes = arrays["image_sizes"][mx.array(which)]
    pixels = arrays["pixel_values"][mx.array(which)].transpose(0, 2, 3, 1)
    *_, hidden = vlm.vision_tower(pixels, output_hidden_states=True, image_sizes=sizes)
    features = vlm.multi_modal_projector(hidden[vlm.vision_feature_layer])
    features = features.reshape(-1, features.shape[-1])
    patch = vlm.config.vision_config.patch_size
    return split(features, [(int(h) // patch) * (int(w) // patch) for h, w in np.array(sizes)])


def join(features: List[mx.array]) -> mx.array:
    return mx.concatenate(features)


def gather(parts: List[Tuple[Dict[str, mx.array], List[int]]]) -> Dict[str, mx.array]:
    """The arrays of the images `which` of each (arrays, which), as one prompt's, padded to
    the largest: the tower crops each image to its `image_sizes` and attends within it."""
    pixels = [arrays["pixel_values"][mx.array(which)] for arrays, which in parts]
    H, W = max(p.shape[2] for p in pixels), max(p.shape[3] for p in pixels)
    pixels = [mx.pad(p, [(0, 0), (0, 0), (0, H - p.shape[2]), (0, W - p.shape[3])]) for p in pixels]
    return {"pixel_values": mx.concatenate(pixels),
            "image_sizes": mx.concatenate([arrays["image_sizes"][mx.array(which)] for arrays, which in parts])}

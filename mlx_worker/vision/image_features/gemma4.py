"""Gemma 4: each image through the tower at its own size and `embed_vision`, (soft tokens,
hidden) an image, as mlx-vlm's tower takes a list of images one by one (and a batch of
equal ones row by row: no image attends to another); a prompt's images one after another."""

from typing import Dict, List

import mlx.core as mx


def encode(vlm, arrays: Dict[str, mx.array], which: List[int]) -> List[mx.array]:
    pixels = arrays["pixel_values"]
    return [vlm.encode_image(mx.array(pixels[i])[None])[0] for i in which]


def join(features: List[mx.array]) -> mx.array:
    return mx.concatenate(features)

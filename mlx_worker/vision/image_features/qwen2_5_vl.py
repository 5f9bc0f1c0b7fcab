"""Qwen2.5-VL (and Qwen3.5, whose Qwen3-VL tower also returns deepstack features it does
not use): the vision tower's merged patches, (t*h*w / merge^2, hidden) an image (its grid
a row of image_grid_thw, its patches consecutive rows of pixel_values); a prompt's
images one after another; several prompts' images in one call of the tower (`gather`)."""

from typing import Dict, List, Tuple

import mlx.core as mx
import numpy as np

from . import rows_of, split


def gather(parts: List[Tuple[Dict[str, mx.array], List[int]]]) -> Dict[str, mx.array]:
    """The arrays of the images `which` of each (arrays, which), as one prompt's: the tower
    attends within each image (its grid), so images of several prompts share a call."""
    grids = [np.array(arrays["image_grid_thw"]) for arrays, _ in parts]
    pixels = [arrays["pixel_values"][mx.array(rows_of(g.prod(axis=1), which))] for g, (arrays, which) in zip(grids, parts)]
    return {"pixel_values": mx.concatenate(pixels),
            "image_grid_thw": np.concatenate([g[which] for g, (_, which) in zip(grids, parts)])}


def encode(vlm, arrays: Dict[str, mx.array], which: List[int]) -> List[mx.array]:
    """The images `which` in one call of the tower (all of a prompt's: as mlx-vlm calls it)."""
    grid = np.array(arrays["image_grid_thw"])
    rows = rows_of(grid.prod(axis=1), which)
    dtype = vlm.vision_tower.patch_embed.proj.weight.dtype
    out = vlm.vision_tower(arrays["pixel_values"][mx.array(rows)].astype(dtype), mx.array(grid[which]))
    if isinstance(out, tuple):  # (features, deepstack features)
        out = out[0]
    merge = vlm.config.vision_config.spatial_merge_size ** 2
    return split(out, grid[which].prod(axis=1) // merge)


def join(features: List[mx.array]) -> mx.array:
    return mx.concatenate(features)

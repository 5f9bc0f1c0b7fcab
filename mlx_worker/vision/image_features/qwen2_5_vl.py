"""Qwen2.5-VL (and Qwen3.5, whose Qwen3-VL tower also returns deepstack features it does
not use): the vision tower's merged patches, (t*h*w / merge^2, hidden) an image (its grid
a row of image_grid_thw, its patches consecutive rows of pixel_values); a prompt's
images one after another."""

from typing import Dict, List

import mlx.core as mx
import numpy as np


def encode(vlm, arrays: Dict[str, mx.array], which: List[int]) -> List[mx.array]:
    """The images `which` in one call of the tower (all of a prompt's: as mlx-vlm calls it)."""
    grid = np.array(arrays["image_grid_thw"])
    starts = np.concatenate([[0], np.cumsum(grid.prod(axis=1))])
    rows = np.concatenate([np.arange(starts[i], starts[i + 1]) for i in which])
    dtype = vlm.vision_tower.patch_embed.proj.weight.dtype
    out = vlm.vision_tower(arrays["pixel_values"][mx.array(rows)].astype(dtype), mx.array(grid[which]))
    if isinstance(out, tuple):  # (features, deepstack features)
        out = out[0]
    merge = vlm.config.vision_config.spatial_merge_size ** 2
    ends = np.cumsum(grid[which].prod(axis=1) // merge)
    return [out[int(a) : int(b)] for a, b in zip([0, *ends[:-1]], ends)]


def join(features: List[mx.array]) -> mx.array:
    return mx.concatenate(features)

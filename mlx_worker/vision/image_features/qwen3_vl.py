"""Qwen3-VL: an image's merged patches and the deepstack features its first text layers
add at its tokens, stacked (1 + layers, tokens, hidden). mlx-vlm's cached-features path
takes the first part only (`join`) and drops the deepstack ones, so the engine adds them
back from here (`deepstack`)."""

from typing import Dict, List

import mlx.core as mx
import numpy as np

from . import rows_of
from .qwen2_5_vl import gather  # noqa: F401  (the same patches and grids)


def encode(vlm, arrays: Dict[str, mx.array], which: List[int]) -> List[mx.array]:
    """The images `which` in one call of the tower (all of a prompt's: as mlx-vlm calls it)."""
    grid = np.array(arrays["image_grid_thw"])
    rows = rows_of(grid.prod(axis=1), which)
    dtype = vlm.vision_tower.patch_embed.proj.weight.dtype
    features, deepstack = vlm.vision_tower(arrays["pixel_values"][mx.array(rows)].astype(dtype), mx.array(grid[which]))
    stacked = mx.stack([features, *deepstack])
    merge = vlm.config.vision_config.spatial_merge_size ** 2
    ends = np.cumsum(grid[which].prod(axis=1) // merge)
    return [stacked[:, int(a) : int(b)] for a, b in zip([0, *ends[:-1]], ends)]


def join(features: List[mx.array]) -> mx.array:
    return mx.concatenate([f[0] for f in features])


def deepstack(features: List[mx.array]) -> List[mx.array]:
    """Per deepstack layer, the prompt's image tokens' features, in order."""
    return list(mx.concatenate(features, axis=1)[1:])

"""Per family: one image's features as its model's `get_input_embeddings` takes them
(`cached_image_features`), and those of a prompt's images joined. A family without a
module here is encoded whole with each request (no image cache)."""

import importlib
from typing import List, Sequence

import numpy as np


def image_features(model_type: str):
    """The family's module (`encode(vlm, arrays, which)`, `join(features)`), or None."""
    try:
        return importlib.import_module(f"{__name__}.{model_type.replace('-', '_')}")  # lfm2-vl
    except ModuleNotFoundError:
        return None


def rows_of(counts: Sequence[int], which: List[int]) -> np.ndarray:
    """The rows of an array that holds `counts[i]` consecutive rows for each image i that
    belong to the images `which`, in order."""
    starts = np.concatenate([[0], np.cumsum(counts)]).astype(int)
    return np.concatenate([np.arange(starts[i], starts[i + 1]) for i in which])


def split(rows, counts: Sequence[int]) -> list:
    """`rows` (an array, or a list) cut into consecutive pieces of `counts` rows."""
    ends = np.cumsum(counts)
    return [rows[int(a) : int(b)] for a, b in zip([0, *ends[:-1]], ends)]

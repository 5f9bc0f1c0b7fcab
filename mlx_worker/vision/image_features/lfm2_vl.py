"""LFM2-VL: an image is its tiles and a thumbnail (or, small, one view), each a row of the
packed pixel_values through the tower, pixel unshuffle and projector (mlx-vlm's
`encode_images`), (its views' tokens, hidden) an image; a prompt's images one after
another. Which views are whose comes from the prompt: an image's runs of image tokens lie
between its `<|image_start|>` and `<|image_end|>`."""

from typing import Dict, List, Optional, Tuple

import mlx.core as mx
import numpy as np

from ..image_inputs import token_runs
from . import rows_of, split


def crops(prompt_ids: List[int], image_token: int, tokenizer, num_images: int) -> Optional[List[int]]:
    """Per image, how many rows of pixel_values are its views (None when the prompt does
    not show it: then images are encoded whole with each request)."""
    ids = np.asarray(prompt_ids)
    run_starts = np.array(token_runs(prompt_ids, image_token)[0], int)
    opens = np.flatnonzero(ids == tokenizer.convert_tokens_to_ids("<|image_start|>"))
    closes = np.flatnonzero(ids == tokenizer.convert_tokens_to_ids("<|image_end|>"))
    if len(opens) != num_images or len(closes) != num_images:
        return None
    counts = [int(((a < run_starts) & (run_starts < b)).sum()) for a, b in zip(opens, closes)]
    return counts if sum(counts) == len(run_starts) and all(counts) else None


def encode(vlm, arrays: Dict[str, mx.array], which: List[int]) -> List[mx.array]:
    """The images `which` in one call of the tower."""
    counts = arrays["crops"]
    rows = mx.array(rows_of(counts, which))
    views = vlm.encode_images(arrays["pixel_values"][rows], spatial_shapes=arrays["spatial_shapes"][rows],
                              pixel_attention_mask=arrays["pixel_attention_mask"][rows])
    return [mx.concatenate(v) for v in split(views, [counts[i] for i in which])]


def join(features: List[mx.array]) -> mx.array:
    return mx.concatenate(features)


def gather(parts: List[Tuple[Dict[str, mx.array], List[int]]]) -> Dict[str, mx.array]:
    """The arrays of the images `which` of each (arrays, which), as one prompt's: views
    packed to the longest (the padding masked out, as within a prompt)."""
    pixels, masks, shapes, counts = [], [], [], []
    for arrays, which in parts:
        rows = mx.array(rows_of(arrays["crops"], which))
        pixels.append(arrays["pixel_values"][rows])
        masks.append(arrays["pixel_attention_mask"][rows])
        shapes.append(arrays["spatial_shapes"][rows])
        counts += [arrays["crops"][i] for i in which]
    n = max(p.shape[1] for p in pixels)
    pixels = [mx.pad(p, [(0, 0), (0, n - p.shape[1]), (0, 0)]) for p in pixels]
    masks = [mx.pad(m, [(0, 0), (0, n - m.shape[1])]) for m in masks]
    return {"pixel_values": mx.concatenate(pixels), "pixel_attention_mask": mx.concatenate(masks),
            "spatial_shapes": mx.concatenate(shapes), "crops": counts}

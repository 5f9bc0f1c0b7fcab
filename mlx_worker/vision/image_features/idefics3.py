"""Idefics3 (and SmolVLM): an image is its tiles and then the whole image, each a row of
pixel_values through the tower and the connector, (rows x image_seq_len, hidden) an
image; a prompt's images one after another. Which rows are whose comes from the prompt:
every image's tokens end with the whole image's, right after its `<global-img>`."""

from typing import Dict, List, Optional, Tuple

import mlx.core as mx
import numpy as np

from ..image_inputs import token_runs
from . import rows_of, split


def crops(prompt_ids: List[int], image_token: int, tokenizer, num_images: int) -> Optional[List[int]]:
    """Per image, how many rows of pixel_values are its (None when the prompt does not
    show it: then images are encoded whole with each request)."""
    ids = np.asarray(prompt_ids)
    starts = np.array(token_runs(prompt_ids, image_token)[0], int)
    closes = ids[starts - 1] == tokenizer.convert_tokens_to_ids("<global-img>")
    ends = np.flatnonzero(closes)
    if len(ends) != num_images or not len(starts) or not closes[-1]:
        return None
    return np.diff(np.concatenate([[-1], ends])).tolist()


def encode(vlm, arrays: Dict[str, mx.array], which: List[int]) -> List[mx.array]:
    """The images `which` in one call of the tower, as mlx-vlm's `get_input_embeddings`
    runs it over a prompt's rows."""
    counts = arrays["crops"]
    rows = mx.array(rows_of(counts, which))
    pixels = arrays["pixel_values"][0][rows]
    mask = arrays.get("pixel_attention_mask")
    mask = mx.ones((pixels.shape[0], *pixels.shape[2:]), mx.bool_) if mask is None else mask[0][rows]
    patch = vlm.config.vision_config.patch_size
    n, height, width = mask.shape
    h, w = height // patch, width // patch
    patches = mask[:, : h * patch, : w * patch].reshape(n, h, patch, w, patch).transpose(0, 1, 3, 2, 4)
    hidden, *_ = vlm.vision_model(pixels.transpose(0, 2, 3, 1), patch_attention_mask=patches.sum(axis=(-1, -2)) > 0,
                                  output_hidden_states=True)
    features = vlm.connector(hidden.astype(pixels.dtype))  # (rows, image_seq_len, hidden)
    return [f.reshape(-1, features.shape[-1]) for f in split(features, [counts[i] for i in which])]


def join(features: List[mx.array]) -> mx.array:
    return mx.concatenate(features)


def gather(parts: List[Tuple[Dict[str, mx.array], List[int]]]) -> Optional[Dict[str, mx.array]]:
    """The arrays of the images `which` of each (arrays, which), as one prompt's (None when
    their tiles differ in size: each prompt's are then encoded apart)."""
    pixels, masks, counts = [], [], []
    for arrays, which in parts:
        rows = mx.array(rows_of(arrays["crops"], which))
        pixels.append(arrays["pixel_values"][:, rows])
        mask = arrays.get("pixel_attention_mask")
        masks.append(mx.ones((1, len(rows), *pixels[-1].shape[3:]), mx.bool_) if mask is None else mask[:, rows])
        counts += [arrays["crops"][i] for i in which]
    if len({p.shape[2:] for p in pixels}) > 1:
        return None
    return {"pixel_values": mx.concatenate(pixels, axis=1), "pixel_attention_mask": mx.concatenate(masks, axis=1),
            "crops": counts}

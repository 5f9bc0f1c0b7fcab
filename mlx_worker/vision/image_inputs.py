"""A prompt's images as the engine takes them: the processor's arrays, each image's
hash, and where its tokens are in the prompt."""

import hashlib
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
from pydantic import BaseModel, ConfigDict


class ImageInputs(BaseModel):
    """`arrays`: what the model's processor returned besides the text (pixel_values, and
    per family image_grid_thw, pixel_attention_mask, ...); `hashes`: one per image, of its
    decoded pixels; `spans`: the prompt positions [start, end) of each image's tokens;
    `crops`: where a family tiles images (Idefics3, SmolVLM), each one's rows of
    pixel_values (None: not known, and its images are encoded whole each request);
    `blocks`: where the model's image tokens attend to each other both ways (Gemma 4's
    larger checkpoints: each run of image tokens), those runs [start, end), else None."""

    model_config = ConfigDict(arbitrary_types_allowed=True)
    arrays: Dict[str, Any]
    hashes: List[str]
    spans: List[Tuple[int, int]]
    crops: Optional[List[int]] = None  # per image, its rows of pixel_values (families that tile images)
    blocks: Optional[List[Tuple[int, int]]] = None

    def shown(self, start: int, end: int) -> bool:
        """Whether image tokens lie in prompt positions [start, end)."""
        return any(s < end and start < e for s, e in self.spans)

    def page_salts(self, num_tokens: int, page_size: int) -> List[bytes]:
        """Per page of the prompt, the hashes of the images whose tokens it holds (b"" for
        none): mixed into the page hashes, so a page that shows an image matches only a
        page that shows the same image (and every later page differs too: hashes chain)."""
        salts = [b""] * (num_tokens // page_size)
        for (start, end), h in zip(self.spans, self.hashes):
            for page in range(start // page_size, min((end - 1) // page_size + 1, len(salts))):
                salts[page] += bytes.fromhex(h)
        return salts


def image_hash(pixels: np.ndarray) -> str:
    """Of an image's decoded pixels (its shape included): the same picture hashes alike
    however it was sent (PNG or WebP, inline or by URL); a different one never does."""
    m = hashlib.blake2b(digest_size=16)
    m.update(str(pixels.shape).encode())
    m.update(np.ascontiguousarray(pixels).tobytes())
    return m.hexdigest()


def token_runs(prompt_ids: List[int], token: int) -> Tuple[List[int], List[int]]:
    """(starts, ends) of the runs of `token` in the prompt."""
    where = np.flatnonzero(np.asarray(prompt_ids) == token)
    if not len(where):
        return [], []
    breaks = np.flatnonzero(np.diff(where) > 1)
    starts = [int(where[0])] + [int(where[b + 1]) for b in breaks]
    ends = [int(where[b]) + 1 for b in breaks] + [int(where[-1]) + 1]
    return starts, ends


def image_spans(prompt_ids: List[int], image_token_id: int, num_images: int,
                crops: Optional[List[int]] = None) -> List[Tuple[int, int]]:
    """Each image's token positions: the runs of the image token, one run per image where
    the processor lays them out so, or `crops` runs each (tiles of one image split by
    other tokens); otherwise every image is taken to span all of them."""
    starts, ends = token_runs(prompt_ids, image_token_id)
    if not starts or not num_images:
        return []
    if len(starts) == num_images:
        return list(zip(starts, ends))
    if crops is not None and sum(crops) == len(starts):
        last = np.cumsum(crops)
        return [(starts[b - n], ends[b - 1]) for n, b in zip(crops, last)]
    return [(starts[0], ends[-1])] * num_images

"""A conversation's text and images as a vision model's prompt, prepared as mlx-vlm's
generation prepares it (`prepare_inputs`): the processor expands each image placeholder
the chat template wrote into the image's tokens and turns the images into the arrays the
vision tower reads."""

from typing import List, Tuple

import numpy as np

from .image_features import image_features
from .image_inputs import ImageInputs, image_hash, image_spans, token_runs

TEXT_KEYS = ("input_ids", "attention_mask", "token_type_ids")


def vision_prompt(processor, config, text: str, images: List) -> Tuple[List[int], ImageInputs]:
    """(prompt ids, image inputs) of a rendered prompt and its decoded images (PIL, in
    order; never paths or URLs: mlx-vlm would open them). `config`: the model's."""
    from mlx_vlm.utils import prepare_inputs, should_add_special_tokens

    if any(isinstance(im, (str, bytes)) for im in images):
        raise TypeError("images must be decoded (PIL), not paths or URLs")
    out = prepare_inputs(processor, images=images, prompts=text,
                         image_token_index=getattr(config, "image_token_index", None),
                         add_special_tokens=should_add_special_tokens(config.model_type, processor))
    ids = np.asarray(out["input_ids"])[0].tolist()
    arrays = {k: _array(v) for k, v in out.items() if k not in TEXT_KEYS and v is not None}
    hashes = [image_hash(np.asarray(im.convert("RGB"))) for im in images]
    image_token = getattr(config, "image_token_index", None) or getattr(config, "image_token_id")
    family = image_features(config.model_type)
    crops = family.crops(ids, image_token, processor.tokenizer, len(images)) if hasattr(family, "crops") else None
    blocks = list(zip(*token_runs(ids, image_token))) if images_attend_both_ways(config) else None
    return ids, ImageInputs(arrays=arrays, hashes=hashes, spans=image_spans(ids, image_token, len(images), crops),
                            crops=crops, blocks=blocks)


def _array(v):
    """One array, or (Gemma 4's images of different sizes) a list of them."""
    try:
        return np.asarray(v)
    except ValueError:
        return [np.asarray(x) for x in v]


def images_attend_both_ways(config) -> bool:
    """Whether the model's image tokens attend to each other both ways (Gemma 4's 26B / 31B)."""
    return getattr(getattr(config, "text_config", None), "use_bidirectional_attention", None) == "vision"

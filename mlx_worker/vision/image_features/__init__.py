"""Per family: one image's features as its model's `get_input_embeddings` takes them
(`cached_image_features`), and those of a prompt's images joined. A family without a
module here is encoded whole with each request (no image cache)."""

import importlib


def image_features(model_type: str):
    """The family's module (`encode(vlm, arrays, which)`, `join(features)`), or None."""
    try:
        return importlib.import_module(f"{__name__}.{model_type.replace('-', '_')}")  # lfm2-vl
    except ModuleNotFoundError:
        return None

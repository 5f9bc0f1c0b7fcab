"""SmolVLM: Idefics3's layout (its own model type)."""

from .idefics3 import crops, encode, gather, join  # noqa: F401

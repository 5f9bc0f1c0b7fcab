"""Qwen3.5: encoded as Qwen2.5-VL's images are (qwen2_5_vl.py)."""

from .qwen2_5_vl import encode, gather, join  # noqa: F401

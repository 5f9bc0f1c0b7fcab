"""The model's tokenizer and context length, for the ingress, without its weights."""

import json
from pathlib import Path
from typing import Optional

DEFAULT_NAME = "SmolLM2-135M-Instruct"


def context_length(path: Path) -> int:
    try:
        cfg = json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        return 32768
    for key in ("max_position_embeddings", "max_seq_len", "n_positions", "seq_length"):
        if isinstance(cfg.get(key), int):
            return cfg[key]
    return 32768


def download_tokenizer(repo: str) -> Path:
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(repo, allow_patterns=["*.json", "*.model", "*.txt", "*.jinja", "*.tiktoken"]))


def served_name(model: Optional[str]) -> str:
    """The name clients use for `model` when none is configured: its last path part,
    less a .gguf suffix (mlx-community/Qwen2.5-7B-Instruct-4bit -> Qwen2.5-7B-Instruct-4bit)."""
    if not model:
        return DEFAULT_NAME
    name = Path(model).name
    return name[: -len(".gguf")] if name.endswith(".gguf") else name

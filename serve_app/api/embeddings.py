"""POST /v1/embeddings: each input's pooled, normalized final hidden state, computed by
the same engine as a prefill-only request (`SamplingParams.embedding`)."""

import base64
import json
from pathlib import Path
from typing import List, Literal, Optional, Union

import numpy as np
from pydantic import BaseModel, ConfigDict, field_validator

Input = Union[str, List[int]]


class EmbeddingRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: Optional[str] = None
    input: Union[str, List[str], List[int], List[List[int]]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Optional[int] = None
    user: Optional[str] = None  # ignored

    @field_validator("input")
    @classmethod
    def _some_input(cls, v):
        items = [v] if isinstance(v, str) or (v and isinstance(v[0], int)) else v
        if not items or any(len(x) == 0 for x in items):
            raise ValueError("must not be empty (nor hold an empty item)")
        return v

    @field_validator("dimensions")
    @classmethod
    def _no_dimensions(cls, v):
        if v is not None:
            raise ValueError("not supported: embeddings have the model's hidden size")
        return v

    def items(self) -> List[Input]:
        """One entry per embedding: a text or a list of token ids."""
        v = self.input
        return [v] if isinstance(v, str) or (v and isinstance(v[0], int)) else list(v)


def pooling(model_dir: Path) -> Literal["last", "mean"]:
    """Mean pooling when the model's sentence-transformers config says so, else the last
    token's state (decoder embedding models such as Qwen3-Embedding)."""
    try:
        cfg = json.loads((Path(model_dir) / "1_Pooling" / "config.json").read_text())
    except (OSError, ValueError):
        return "last"
    return "mean" if cfg.get("pooling_mode_mean_tokens") else "last"


def response(vectors: List[List[float]], model: str, prompt_tokens: int, encoding_format: str) -> dict:
    def encode(v):
        return base64.b64encode(np.asarray(v, np.float32).tobytes()).decode() if encoding_format == "base64" else v

    return {"object": "list", "model": model,
            "data": [{"object": "embedding", "index": i, "embedding": encode(v)} for i, v in enumerate(vectors)],
            "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}}

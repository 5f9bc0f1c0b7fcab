"""The `engine.speculative` keys of deploy/app.yaml."""

from typing import Literal

from pydantic import Field, field_validator

from ..strict_model import StrictModel

NOT_YET = {"draft": "a draft model", "mtp": "a checkpoint's MTP heads"}


class SpeculativeConfig(StrictModel):
    method: Literal["ngram", "suffix"] = "ngram"
    """ngram: prompt lookup (the request's own prompt and output); suffix: also the outputs of recent requests."""
    num_draft_tokens: int = Field(4, ge=1, le=16)
    """Draft tokens per row and step at most; the engine drafts fewer where they do not pay."""
    adaptive: bool = True
    """Draft only where the measured acceptance and verify cost say it pays; false: always num_draft_tokens when a draft is found."""

    @field_validator("method", mode="before")
    @classmethod
    def _built(cls, method):
        if method in NOT_YET:
            raise ValueError(f"method {method!r} ({NOT_YET[method]}) is not built yet: use 'ngram' or 'suffix'")
        return method

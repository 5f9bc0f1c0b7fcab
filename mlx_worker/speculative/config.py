"""The `engine.speculative` keys of deploy/app.yaml."""

from typing import Literal, Optional

from pydantic import Field, model_validator

from ..strict_model import StrictModel

class SpeculativeConfig(StrictModel):
    method: Literal["ngram", "suffix", "draft", "mtp"] = "ngram"
    """ngram: prompt lookup (the request's own prompt and output); suffix: also the outputs of recent requests; draft: a small model with the same tokenizer (draft_model); mtp: the checkpoint's own multi-token-prediction head (Qwen3-Next, Qwen3.5, GLM-4 MoE, DeepSeek-V3)."""
    num_draft_tokens: int = Field(4, ge=1, le=16)
    """Draft tokens per row and step at most; the engine drafts fewer where they do not pay."""
    adaptive: bool = True
    """Draft only where the measured acceptance and verify cost say it pays; false: always num_draft_tokens when a draft is found."""
    draft_model: Optional[str] = None
    """Method draft: a Hugging Face id, mlx-lm directory or .gguf file of a small model with the target's tokenizer."""

    @model_validator(mode="after")
    def _draft_model_with_method_draft(self):
        if self.method == "draft" and not self.draft_model:
            raise ValueError("method 'draft' needs draft_model: a small model with the target's tokenizer")
        if self.draft_model and self.method != "draft":
            raise ValueError(f"draft_model is used by method 'draft' only, not {self.method!r}")
        return self

"""LoRA adapters served beside their base model: rows of one batch under different adapters."""

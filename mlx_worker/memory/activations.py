"""The memory a step may take beyond the weights and the KV: the activation budget.

A prefill chunk of L tokens holds a few hidden- and MLP-width activations per token,
and, where attention is not fused (MLX's CPU backend), scores of L x Lk per head with
their exp and softmax; for a chunk over its own length of keys that is 3 x heads x L
floats a token. Sampling holds a few vocabulary-wide rows per sampled row.
"""

FLOAT_BYTES = 4  # scores, softmax and logits run in float32


def activation_budget(model, tokens: int, rows: int, vocab: int) -> int:
    """Bytes one step of `tokens` tokens and `rows` sampled rows may hold at once."""
    args = getattr(model, "args", None)
    hidden = getattr(args, "hidden_size", 4096)
    inter = getattr(args, "intermediate_size", None) or 4 * hidden
    heads = getattr(args, "num_attention_heads", 32)
    per_token = 4 * hidden + 3 * inter + 3 * heads * tokens
    return FLOAT_BYTES * (tokens * per_token + 4 * rows * vocab)

"""Tiny random-weight mlx-lm models for tests: real architectures, loaded in milliseconds."""

import importlib
import json
from pathlib import Path
from typing import Optional

import mlx_worker  # noqa: F401  (before mlx: binds MLX to OpenBLAS on Linux)
import mlx.core as mx
from mlx.utils import tree_flatten, tree_map

VOCAB = 49152  # the default model's tokenizer, so tiny models can share it
WEIGHT_SCALE = 4.0

CONFIGS = {
    "llama": dict(
        model_type="llama", hidden_size=64, num_hidden_layers=2, intermediate_size=128,
        num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=VOCAB,
        rope_theta=10000.0, tie_word_embeddings=False,
    ),
    "qwen3": dict(
        model_type="qwen3", hidden_size=64, num_hidden_layers=2, intermediate_size=128,
        num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6, vocab_size=VOCAB,
        max_position_embeddings=4096, head_dim=32, tie_word_embeddings=False, rope_theta=1e6,
    ),
    # Sliding-window layers (window 8) interleaved with global ones.
    "gemma3_text": dict(
        model_type="gemma3_text", hidden_size=64, num_hidden_layers=4, intermediate_size=128,
        num_attention_heads=4, num_key_value_heads=1, head_dim=16, vocab_size=VOCAB,
        query_pre_attn_scalar=16, sliding_window=8, sliding_window_pattern=2,
    ),
    # Its forward needs one integer offset for the whole batch: a ragged decode step raises.
    "gpt_bigcode": dict(
        model_type="gpt_bigcode", n_embd=64, n_layer=2, n_inner=128, n_head=4, n_positions=1024,
        layer_norm_epsilon=1e-5, vocab_size=VOCAB,
    ),
}


def config(arch: str) -> dict:
    from arch_configs import ARCH_CONFIGS

    return CONFIGS[arch] if arch in CONFIGS else ARCH_CONFIGS[arch]


def make_tiny_model(arch: str, seed: int = 0, dtype=mx.float32, **overrides):
    """A random-weight model of mlx-lm's own class for `arch` (a module of mlx_lm.models)."""
    module = importlib.import_module(f"mlx_lm.models.{arch}")
    args = module.ModelArgs.from_dict({**config(arch), **overrides})
    mx.random.seed(seed)
    model = module.Model(args)
    # Larger weights than the default init make outputs depend on the whole context
    # (not just the last token) and keep logits peaked, so greedy ties are rare.
    model.update(tree_map(lambda w: w * WEIGHT_SCALE if w.ndim == 2 and mx.issubdtype(w.dtype, mx.floating) else w,
                          model.parameters()))
    model.set_dtype(dtype)
    mx.eval(model.parameters())
    return model


def save_tiny_model(arch: str, path: Path, tokenizer_dir: Optional[Path] = None, seed: int = 0, **overrides) -> Path:
    """Write a tiny model as an mlx-lm directory (weights + config + tokenizer files)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model = make_tiny_model(arch, seed, **overrides)
    mx.save_safetensors(str(path / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (path / "config.json").write_text(json.dumps({**config(arch), "max_position_embeddings": 1024, **overrides}))
    if tokenizer_dir is not None:
        for f in Path(tokenizer_dir).iterdir():
            if f.name.startswith(("tokenizer", "special_tokens", "generation_config")):
                (path / f.name).write_bytes(f.read_bytes())
    return path

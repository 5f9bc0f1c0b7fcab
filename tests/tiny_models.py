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


def save_tiny_adapter(model_dir: Path, path: Path, keys, seed: int = 0, rank: int = 4, scale: float = 2.0,
                      dora: bool = False, num_layers: Optional[int] = None) -> Path:
    """A random LoRA (or DoRA) adapter in mlx-lm's format for the model at `model_dir`,
    made by mlx-lm's own `linear_to_lora_layers` (B random: a zero B changes nothing)."""
    from mlx_lm import load
    from mlx_lm.tuner.utils import linear_to_lora_layers

    model, _ = load(str(model_dir))
    num_layers = len(model.layers) if num_layers is None else num_layers
    lora = {"rank": rank, "scale": scale, "dropout": 0.0, "keys": list(keys)}
    mx.random.seed(seed)
    linear_to_lora_layers(model, num_layers, lora, use_dora=dora)
    weights = {}
    for k, v in tree_flatten(model.trainable_parameters()):
        leaf = k.rsplit(".", 1)[-1]
        if leaf == "lora_b":
            v = mx.random.normal(v.shape) * 0.5
        elif leaf == "m":
            v = v * (1 + 0.2 * mx.random.uniform(shape=v.shape))
        if leaf in ("lora_a", "lora_b", "m"):
            weights[k] = v
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(path / "adapters.safetensors"), weights)
    (path / "adapter_config.json").write_text(json.dumps(
        {"fine_tune_type": "dora" if dora else "lora", "num_layers": num_layers, "lora_parameters": lora}))
    return path


def mlx_adapter_as_peft(src: Path, dst: Path, target_modules) -> Path:
    """The same LoRA weights in PEFT's format (lora_A [r, in], lora_B [out, r], lora_alpha)."""
    src, dst = Path(src), Path(dst)
    cfg = json.loads((src / "adapter_config.json").read_text())
    lora = cfg["lora_parameters"]
    weights = mx.load(str(src / "adapters.safetensors"))
    peft = {}
    for k, v in weights.items():
        module, leaf = k.rsplit(".", 1)
        name = {"lora_a": "lora_A.weight", "lora_b": "lora_B.weight", "m": "lora_magnitude_vector"}[leaf]
        peft[f"base_model.model.{module}.{name}"] = v.T if leaf != "m" else v
    dst.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(dst / "adapter_model.safetensors"), peft)
    (dst / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": lora["rank"], "lora_alpha": lora["scale"] * lora["rank"],
        "target_modules": target_modules, "use_dora": cfg["fine_tune_type"] == "dora", "use_rslora": False,
        "layers_to_transform": None, "bias": "none"}))
    return dst

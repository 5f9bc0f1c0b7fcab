"""The engine on the embedded default model (SmolLM2-135M-Instruct) matches mlx-lm."""

import pytest
from conftest import reference_greedy, run_requests

from mlx_worker import Engine, EngineConfig
from mlx_worker.models.loader import load_model

QUESTIONS = ["What is the capital of France?", "Write a haiku about the sea.", "List three prime numbers."]


@pytest.fixture(scope="module")
def default_model():
    return load_model(None)  # float32 on CPU, quantized on Metal


def test_default_model_greedy_equals_mlx_lm(default_model):
    model, tok = default_model
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True) for q in QUESTIONS]
    eng = Engine(EngineConfig(max_total_tokens=2048), model=model, tokenizer=tok)
    outs = run_requests(eng, prompts, 12)
    for p, (toks, _) in zip(prompts, outs):
        assert toks == reference_greedy(model, p, 12)
    assert "Paris" in tok.decode(outs[0][0])
    eng.shutdown()

"""Structured output through the engine: the constrained text parses and validates."""

import asyncio
import json
import random
import re

import jsonschema
import pytest
from conftest import collect, default_tokenizer, reference_greedy
from tiny_models import make_tiny_model

from mlx_worker import Engine, EngineConfig, Request, SamplingParams
from mlx_worker.sampling.grammar import GrammarSpec

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "ok": {"type": "boolean"},
        "color": {"enum": ["red", "green", "blue"]},
    },
    "required": ["name", "age", "ok", "color"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def engine():
    eng = Engine(EngineConfig(max_total_tokens=4096), model=make_tiny_model("llama"), tokenizer=default_tokenizer())
    yield eng
    eng.shutdown()


def prompt(seed):
    rng = random.Random(seed)
    return [rng.randrange(100, 40000) for _ in range(12)]


def run(engine, reqs):
    async def main():
        return await asyncio.gather(*[collect(engine, r) for r in reqs])

    return asyncio.run(main())


def texts(engine, spec, n=4, **kw):
    reqs = [
        Request(rid=f"{spec.kind()}{i}", prompt_ids=prompt(i),
                params=SamplingParams(max_tokens=120, seed=i, structured=spec, **kw))
        for i in range(n)
    ]
    outs = run(engine, reqs)
    for _, last in outs:
        assert last.finish_reason == "stop"
    return [engine.tokenizer.decode(t, skip_special_tokens=True) for t, _ in outs]


def test_json_schema_output_validates(engine):
    for text in texts(engine, GrammarSpec(json_schema=SCHEMA)):
        jsonschema.validate(json.loads(text), SCHEMA)


def test_json_object_output_parses_with_the_default_model():
    from mlx_worker.models.loader import load_model

    model, tok = load_model(None)
    eng = Engine(EngineConfig(max_total_tokens=2048), model=model, tokenizer=tok)
    ids = tok.apply_chat_template(
        [{"role": "user", "content": "Give a JSON object with the name and age of a person."}], add_generation_prompt=True
    )
    params = SamplingParams(temperature=0.0, max_tokens=60, structured=GrammarSpec(json_object=True))
    (toks, last), = run(eng, [Request(rid="obj", prompt_ids=ids, params=params)])
    assert last.finish_reason == "stop"
    assert isinstance(json.loads(tok.decode(toks, skip_special_tokens=True)), dict)
    eng.shutdown()


def test_regex_and_choice(engine):
    for text in texts(engine, GrammarSpec(regex=r"[a-c]{3}-\d{2}")):
        assert re.fullmatch(r"[a-c]{3}-\d{2}", text)
    for text in texts(engine, GrammarSpec(choice=["red", "green", "blue"])):
        assert text in {"red", "green", "blue"}


def test_constrained_next_to_free_requests_keeps_free_ones_exact(engine):
    free = [prompt(50 + i) for i in range(3)]
    reqs = [Request(rid=f"free{i}", prompt_ids=p, params=SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True))
            for i, p in enumerate(free)]
    reqs.append(Request(rid="json", prompt_ids=prompt(9), params=SamplingParams(max_tokens=120, seed=3, structured=GrammarSpec(json_schema=SCHEMA))))
    outs = run(engine, reqs)
    for p, (toks, _) in zip(free, outs):
        assert toks == reference_greedy(engine.model, p, 10)
    jsonschema.validate(json.loads(engine.tokenizer.decode(outs[-1][0], skip_special_tokens=True)), SCHEMA)


@pytest.mark.parametrize("spec", [dict(json_schema={"type": "nonsense"}), dict(regex="(unclosed")])
def test_invalid_grammar_is_a_clear_error(engine, spec):
    with pytest.raises(ValueError, match="invalid"):
        run(engine, [Request(rid="bad", prompt_ids=prompt(1), params=SamplingParams(structured=GrammarSpec(**spec)))])

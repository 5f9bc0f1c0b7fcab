"""`deploy/app.yaml`'s args with `speculative: {method: ngram}` added to its engine section,
as a user turns it on, on the local cluster the served tests share (`serve run` of the file
is test_serve_run's; a cluster of its own costs 30 s), with the real openai and anthropic
clients: a request to
rewrite a file gets, greedy and seeded, the answer of the engine without speculation,
on the completions, chat (streamed or not) and Anthropic endpoints; and drafts were
verified and accepted on the way."""

import asyncio
from pathlib import Path

import anthropic
import httpx
import pytest
import yaml
from openai import OpenAI
from serve_fixtures import run_app, serving

from mlx_worker import Engine, EngineConfig, Request, SamplingParams
from mlx_worker.models.loader import load_model

ROOT = Path(__file__).resolve().parents[1]
CODE = ("def add(a, b):\n    return a + b\n\n\ndef mul(a, b):\n    return a * b\n\n\n"
        "def sub(a, b):\n    return a - b\n")
MESSAGES = [{"role": "user", "content": f"Here is my code:\n```python\n{CODE}```\nRewrite it exactly, in a code block."}]
MAX_TOKENS = 30


@pytest.fixture(scope="module")
def deployed():
    args = yaml.safe_load((ROOT / "deploy" / "app.yaml").read_text())["applications"][0]["args"]
    args["engine"]["speculative"] = {"method": "ngram"}
    with serving() as base:
        run_app(base, "speculative", "/speculative", **args)
        httpx.get(f"{base}/speculative/v1/stats", timeout=60)
        yield f"{base}/speculative"


@pytest.fixture(scope="module")
def without_speculation():
    """The answers of the same model in an engine without speculation: text by params."""
    model, tok = load_model()
    engine = Engine(EngineConfig(max_total_tokens=2048), model=model, tokenizer=tok)
    ids = tok.apply_chat_template(MESSAGES, add_generation_prompt=True)

    def answer(**params):
        async def main():
            text = ""
            async for out in engine.generate(Request(rid=f"ref{params}", prompt_ids=ids,
                                                     params=SamplingParams(max_tokens=MAX_TOKENS, **params))):
                text += out.text
            return text

        return asyncio.run(main())

    yield ids, answer
    engine.shutdown()


def test_greedy_and_seeded_answers_are_those_without_speculation(deployed, without_speculation):
    ids, answer = without_speculation
    client = OpenAI(base_url=f"{deployed}/v1", api_key="unused", timeout=120)
    model = client.models.list().data[0].id
    greedy = answer(temperature=0.0)
    assert "return a + b" in greedy
    r = client.completions.create(model=model, prompt=ids, max_tokens=MAX_TOKENS, temperature=0)
    assert r.choices[0].text == greedy and r.usage.completion_tokens <= MAX_TOKENS
    chat = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0)
    assert chat.choices[0].message.content == greedy
    stream = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == greedy
    assert chunks[-1].usage.completion_tokens == chat.usage.completion_tokens
    message = anthropic.Anthropic(base_url=deployed, api_key="unused").messages.create(
        model=model, max_tokens=MAX_TOKENS, messages=MESSAGES, extra_body={"temperature": 0})  # no SDK argument
    assert message.content[0].text == greedy
    seeded = client.completions.create(model=model, prompt=ids, max_tokens=MAX_TOKENS, temperature=0.7, seed=5)
    assert seeded.choices[0].text == answer(temperature=0.7, seed=5)
    spec = httpx.get(f"{deployed}/v1/stats", timeout=10).json()["replica"]["speculative"]
    assert spec["method"] == "ngram" and spec["accepted_tokens"] > 0

"""OpenAI's Responses API (/v1/responses) through the served app and the real `openai`
client: text, the streamed event sequence, forced function calls and their outputs in
the input, JSON-schema text format, the token limit, and refusals of what is not served."""

import json

import jsonschema
import openai
import pytest
from conftest import reference_greedy
from mlx_lm import load as mlx_load
from serve_fixtures import ENGINE, run_app, serving, tiny_model_dir

WEATHER = {"type": "function", "name": "get_weather", "description": "Weather in a city.",
           "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}},
                          "required": ["city"], "additionalProperties": False}}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    path = str(tiny_model_dir(tmp_path_factory))
    with serving() as url:
        run_app(url, "responses", "/", model=path, model_name="tiny", engine=ENGINE, router="pow2")
        model, tok = mlx_load(path)
        yield url, model, tok


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=f"{served[0]}/v1", api_key="unused", max_retries=0)


def test_text_response_equals_greedy(served, client):
    _, model, tok = served
    r = client.responses.create(model="tiny", instructions="Be terse.", input="Name a colour.",
                                max_output_tokens=10, temperature=0)
    ids = tok.apply_chat_template([{"role": "system", "content": "Be terse."},
                                   {"role": "user", "content": "Name a colour."}], add_generation_prompt=True)
    assert r.object == "response" and r.id.startswith("resp_")
    assert r.output_text == tok.decode(reference_greedy(model, ids, 10), skip_special_tokens=True)
    assert r.usage.input_tokens == len(ids) and r.usage.output_tokens <= 10
    assert r.status in ("completed", "incomplete")
    if r.status == "incomplete":
        assert r.incomplete_details.reason == "max_output_tokens"


def test_stream_events_end_in_the_same_response(client):
    kw = dict(model="tiny", input=[{"role": "user", "content": [{"type": "input_text", "text": "Hello"}]}],
              max_output_tokens=10, temperature=0)
    whole = client.responses.create(**kw)
    events = list(client.responses.create(stream=True, **kw))
    kinds = [e.type for e in events]
    assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text == events[-1].response.output_text


@pytest.mark.parametrize("choice", ["required", {"type": "function", "name": "get_weather"}])
def test_forced_function_call_and_its_output(client, choice):
    kw = dict(model="tiny", input="Weather in Paris?", tools=[WEATHER], tool_choice=choice, max_output_tokens=64,
              temperature=0)
    r = client.responses.create(**kw)
    calls = [o for o in r.output if o.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather"
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER["parameters"])
    events = list(client.responses.create(stream=True, **kw))
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert args == calls[0].arguments
    follow = client.responses.create(model="tiny", tools=[WEATHER], max_output_tokens=6, temperature=0, input=[
        {"role": "user", "content": "Weather in Paris?"},
        {"type": "function_call", "call_id": calls[0].call_id, "name": "get_weather", "arguments": calls[0].arguments},
        {"type": "function_call_output", "call_id": calls[0].call_id, "output": "Sunny"}])
    assert follow.usage.input_tokens > r.usage.input_tokens


def test_json_schema_text_format(client):
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
              "additionalProperties": False}
    r = client.responses.create(model="tiny", input="A number as JSON.", max_output_tokens=40, temperature=0,
                                text={"format": {"type": "json_schema", "name": "num", "schema": schema}})
    jsonschema.validate(json.loads(r.output_text), schema)


def test_what_is_not_served_is_a_clear_400(client):
    for kw, words in [({"previous_response_id": "resp_1"}, "previous_response_id"), ({"store": True}, "store"),
                      ({"tools": [{"type": "web_search"}]}, "function tools"),
                      ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, "nope")]:
        with pytest.raises(openai.BadRequestError, match=words):
            client.responses.create(model="tiny", input="hi", max_output_tokens=4, **kw)

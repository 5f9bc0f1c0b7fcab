"""Anthropic's Messages API (/v1/messages) through the served app and the real `anthropic`
client: text, streaming events, tool use (forced with tool_choice any / tool), tool
results in the history, count_tokens, prompt-cache reads, errors in Anthropic's shape."""

import json

import anthropic
import httpx
import jsonschema
import pytest
from conftest import reference_greedy
from mlx_lm import load as mlx_load
from serve_fixtures import ENGINE, run_app, serving, tiny_model_dir

KEY = "sk-ant-test"
WEATHER = {"name": "get_weather", "description": "Weather in a city.",
           "input_schema": {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}},
                            "required": ["city"], "additionalProperties": False}}
SYSTEM = "You are a terse assistant."
MSGS = [{"role": "user", "content": "Name a colour."}]
GREEDY = {"temperature": 0}  # the current SDK has no temperature argument; the API still takes it


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    path = str(tiny_model_dir(tmp_path_factory))
    with serving() as url:
        run_app(url, "anthropic", "/", model=path, model_name="tiny", engine=ENGINE, router="pow2", api_key=KEY)
        model, tok = mlx_load(path)
        yield url, model, tok


@pytest.fixture(scope="module")
def client(served):
    return anthropic.Anthropic(base_url=served[0], api_key=KEY, max_retries=0)


def greedy_text(served, n):
    _, model, tok = served
    ids = tok.apply_chat_template([{"role": "system", "content": SYSTEM}] + MSGS, add_generation_prompt=True)
    return tok.decode(reference_greedy(model, ids, n), skip_special_tokens=True), ids


def test_text_message_equals_greedy_and_counts_tokens(served, client):
    r = client.messages.create(model="tiny", system=SYSTEM, messages=MSGS, max_tokens=10, extra_body=GREEDY)
    text, ids = greedy_text(served, 10)
    assert r.type == "message" and r.role == "assistant" and r.id.startswith("msg_")
    assert [b.type for b in r.content] == ["text"] and r.content[0].text == text
    assert r.stop_reason in ("max_tokens", "end_turn")
    assert r.usage.input_tokens + r.usage.cache_read_input_tokens == len(ids) and r.usage.output_tokens <= 10
    assert client.messages.count_tokens(model="tiny", system=SYSTEM, messages=MSGS).input_tokens == len(ids)
    again = client.messages.create(model="tiny", system=SYSTEM, messages=MSGS, max_tokens=10, extra_body=GREEDY)
    assert again.usage.cache_read_input_tokens > 0  # the same prefix: read from the prefix cache


def test_stream_events_join_to_the_same_message(client):
    kw = dict(model="tiny", system=SYSTEM, messages=MSGS, max_tokens=10, extra_body=GREEDY)
    whole = client.messages.create(**kw)
    with client.messages.stream(**kw) as stream:
        events = [e.type for e in stream]
        final = stream.get_final_message()
    assert events[0] == "message_start" and events[-1] == "message_stop"
    assert "content_block_start" in events and "content_block_stop" in events and "message_delta" in events
    assert final.content[0].text == whole.content[0].text and final.stop_reason == whole.stop_reason


@pytest.mark.parametrize("choice", [{"type": "any"}, {"type": "tool", "name": "get_weather"}])
def test_forced_tool_use_streamed_and_not(client, choice):
    kw = dict(model="tiny", messages=[{"role": "user", "content": "Weather in Paris?"}], max_tokens=64,
              extra_body=GREEDY, tools=[WEATHER], tool_choice=choice)
    r = client.messages.create(**kw)
    uses = [b for b in r.content if b.type == "tool_use"]
    assert r.stop_reason == "tool_use" and len(uses) == 1 and uses[0].name == "get_weather"
    jsonschema.validate(uses[0].input, WEATHER["input_schema"])
    with client.messages.stream(**kw) as stream:
        deltas = [e.delta.type for e in stream if e.type == "content_block_delta"]
        final = stream.get_final_message()
    assert "input_json_delta" in deltas
    assert [(b.name, b.input) for b in final.content if b.type == "tool_use"] == [(uses[0].name, uses[0].input)]
    assert final.stop_reason == "tool_use"


def test_tool_result_in_the_history(client):
    msgs = [{"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                               "input": {"city": "Paris"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "Sunny, 21C"}]}]
    r = client.messages.create(model="tiny", messages=msgs, max_tokens=8, extra_body=GREEDY, tools=[WEATHER])
    assert r.content and r.usage.output_tokens > 0


def test_errors_take_anthropics_shape(served, client):
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model="tiny", messages=MSGS, max_tokens=8, tools=[WEATHER],
                               tool_choice={"type": "tool", "name": "nope"})
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "invalid_request_error"
    assert "nope" in e.value.body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError, match="tool_use_id|tool_call_id"):
        client.messages.create(model="tiny", max_tokens=8, messages=[
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_x", "content": "?"}]}])
    r = httpx.post(f"{served[0]}/v1/messages", headers={"x-api-key": KEY},
                   json={"model": "tiny", "messages": MSGS}, timeout=30)  # no max_tokens
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", r.text
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=served[0], api_key="wrong", max_retries=0).messages.create(
            model="tiny", messages=MSGS, max_tokens=4)
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(model="other", messages=MSGS, max_tokens=4)
    r = httpx.post(f"{served[0]}/v1/messages", headers={"x-api-key": KEY}, content=b"{not json", timeout=30)
    assert r.status_code == 400 and json.loads(r.text)["type"] == "error"

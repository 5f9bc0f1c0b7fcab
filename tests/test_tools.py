"""Tool calling on /v1/chat/completions through the served app and the real openai client.

The tiny model shares the embedded SmolLM2's tokenizer and template, which know no
tool-call format: the tools go into the system prompt and calls use the fallback format
(`<tool_call>{"name": ..., "arguments": ...}</tool_call>`). A random-weight model makes
calls only when constrained, so `required` and named choices carry the call tests, also
through LangChain and the OpenAI Agents SDK."""

import json
from typing import Literal

import httpx
import jsonschema
import openai
import pytest
from mlx_lm.utils import load_tokenizer
from pydantic import BaseModel, Field
from serve_fixtures import ENGINE, run_app, serving, tiny_model_dir

from serve_app.api.output_parser import OutputParser
from serve_app.api.tools import FunctionDef, Tool, call_format

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome", "Oslo"]},
                                                    "celsius": {"type": "boolean"}},
                   "required": ["city", "celsius"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
                                       "required": ["zone"], "additionalProperties": False}}}
TOOLS = [WEATHER, TIME]
MSGS = [{"role": "user", "content": "What is the weather in Paris?"}]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    path = str(tiny_model_dir(tmp_path_factory, max_position_embeddings=8192))  # room for a long agent prompt
    with serving() as url:
        run_app(url, "tools", "/", model=path, model_name="tiny", engine=ENGINE, router="pow2")
        yield url


@pytest.fixture(scope="module")
def client(base):
    return openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)


def check_call(call, name=None):
    assert call.type == "function" and call.id.startswith("call_")
    assert name is None or call.function.name == name
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_required_tool_choice_gives_a_valid_call(client):
    r = client.chat.completions.create(model="tiny", messages=MSGS, tools=TOOLS, tool_choice="required",
                                       temperature=0, max_tokens=64)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert choice.message.content is None and len(choice.message.tool_calls) == 1
    check_call(choice.message.tool_calls[0])


def test_named_tool_choice_streamed_equals_non_streamed(client):
    kw = dict(model="tiny", messages=MSGS, tools=TOOLS, temperature=0, max_tokens=64,
              tool_choice={"type": "function", "function": {"name": "get_time"}})
    whole = client.chat.completions.create(**kw).choices[0]
    check_call(whole.message.tool_calls[0], "get_time")
    calls, content, reasons = {}, "", []
    for chunk in client.chat.completions.create(stream=True, **kw):
        for ch in chunk.choices:
            content += ch.delta.content or ""
            for tc in ch.delta.tool_calls or []:
                c = calls.setdefault(tc.index, {"id": None, "name": "", "arguments": ""})
                c["id"] = c["id"] or tc.id
                c["name"] += tc.function.name or ""
                c["arguments"] += tc.function.arguments or ""
            reasons.append(ch.finish_reason)
    assert content == "" and "<tool_call>" not in content
    assert [(c["name"], c["arguments"]) for c in calls.values()] == \
        [(whole.message.tool_calls[0].function.name, whole.message.tool_calls[0].function.arguments)]
    assert reasons[-1] == "tool_calls"


def test_a_tool_using_conversation_renders_and_answers(client):
    first = client.chat.completions.create(model="tiny", messages=MSGS, tools=TOOLS, tool_choice="required",
                                           temperature=0, max_tokens=64).choices[0].message
    call = first.tool_calls[0]
    history = MSGS + [first.model_dump(exclude_none=True),
                      {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temp": 21})}]
    r = client.chat.completions.create(model="tiny", messages=history, tools=TOOLS, temperature=0, max_tokens=8)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    none = client.chat.completions.create(model="tiny", messages=history, tools=TOOLS, tool_choice="none",
                                          temperature=0, max_tokens=8).choices[0]
    assert none.message.tool_calls is None and none.finish_reason in ("stop", "length")


def test_an_agent_loop_reads_its_stable_prefix_from_the_cache(client):
    """10 turns of a tool-using loop over a ~2,000-token system prompt: from turn 2 on at
    least 90% of each prompt's tokens come from the prefix cache."""
    system = " ".join(f"Rule {i}: answer tersely, cite tool results, never guess the weather." for i in range(150))
    history = [{"role": "system", "content": system}, {"role": "user", "content": "Weather in Paris, then Rome?"}]
    shares = []
    for turn in range(10):
        r = client.chat.completions.create(model="tiny", messages=history, tools=TOOLS, tool_choice="required",
                                           temperature=0, max_tokens=64)
        call = r.choices[0].message.tool_calls[0]
        shares.append(r.usage.prompt_tokens_details.cached_tokens / r.usage.prompt_tokens)
        history += [r.choices[0].message.model_dump(exclude_none=True),
                    {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"turn": turn, "temp": 20 + turn})}]
    assert r.usage.prompt_tokens > 2000
    assert min(shares[1:]) >= 0.9, shares


@pytest.mark.parametrize("body, words", [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "not among the tools"),
    ({"tool_choice": "required"}, "needs tools"),
    ({"messages": MSGS + [{"role": "tool", "tool_call_id": "call_x", "content": "1"}], "tools": TOOLS},
     "no assistant message called"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "no-such-type"}}}}}], "tool_choice": "required"}, ""),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "cannot be combined"),
])
def test_bad_tool_requests_are_400(base, body, words):
    r = httpx.post(f"{base}/v1/chat/completions", json={"messages": MSGS, "max_tokens": 4, **body}, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and words in err["message"], err


def test_markup_never_leaks_into_content_whatever_the_chunking():
    fmt = call_format(object())  # no native format: the fallback
    text = 'Sure. <tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}</tool_call> Then <tool_ca'
    for size in (1, 2, 5, 13, len(text)):
        p = OutputParser(None, fmt, [Tool(type="function", function=FunctionDef(name="get_time"))])
        pieces = [p.feed(text[i:i + size]) for i in range(0, len(text), size)] + [p.finish("stop")]
        content = "".join(x.content for x in pieces)
        calls = [c for x in pieces for c in x.calls]
        assert content == "Sure.  Then ", (size, content)
        assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [("get_time", {"zone": "UTC"})]


def test_call_arguments_stream_in_pieces_that_join_to_the_call():
    fmt = call_format(object())
    text = '<tool_call>{"name": "get_time", "arguments": {"zone": "UTC", "n": [1, 2]}}</tool_call>'
    p = OutputParser(None, fmt, [Tool(type="function", function=FunctionDef(name="get_time"))])
    parsed = [p.feed(text[i:i + 3]) for i in range(0, len(text), 3)] + [p.finish("stop")]
    pieces = [c for x in parsed for c in x.pieces]
    calls = [c for x in parsed for c in x.calls]
    assert pieces[0].name == "get_time" and pieces[0].id == calls[0].id and pieces[-1].done
    assert len([c for c in pieces if c.arguments]) > 3  # streamed as generated, not at the end
    assert "".join(c.arguments for c in pieces) == calls[0].function.arguments
    assert json.loads(calls[0].function.arguments) == {"zone": "UTC", "n": [1, 2]}


# A Hermes/Qwen-style template: mlx-lm's TokenizerWrapper then knows the format (json_tools).
HERMES_TEMPLATE = """{%- if tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}

{% endif %}# Tools
<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools>
For each function call, return a json object within <tool_call></tool_call> tags.<|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}{%- for message in messages %}{%- if message.role == 'user' %}<|im_start|>user
{{ message.content }}<|im_end|>
{% elif message.role == 'assistant' %}<|im_start|>assistant
{{ message.content }}{% for tool_call in message.tool_calls or [] %}{% set tool_call = tool_call.function %}<tool_call>
{"name": "{{ tool_call.name }}", "arguments": {{ tool_call.arguments | tojson }}}
</tool_call>{% endfor %}<|im_end|>
{% elif message.role == 'tool' %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% endif %}{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


@pytest.fixture(scope="module")
def native(base, tmp_path_factory):
    """An app on a tiny model whose template renders tools (Hermes style)."""
    path = tiny_model_dir(tmp_path_factory)
    cfg_file = path / "tokenizer_config.json"
    cfg = json.loads(cfg_file.read_text())
    cfg["chat_template"] = HERMES_TEMPLATE
    cfg_file.write_text(json.dumps(cfg))
    (path / "chat_template.jinja").unlink(missing_ok=True)
    run_app(base, "native", "/native", model=str(path), model_name="tiny", engine=ENGINE, router="pow2")
    tok = load_tokenizer(path)
    assert tok.has_tool_calling and tok.tool_call_start == "<tool_call>"
    return openai.OpenAI(base_url=f"{base}/native/v1", api_key="unused", max_retries=0), tok


def test_a_template_with_tools_renders_them_and_its_format_is_used(native):
    client, tok = native
    r = client.chat.completions.create(model="tiny", messages=MSGS, tools=TOOLS, tool_choice="required",
                                       temperature=0, max_tokens=64)
    assert r.usage.prompt_tokens == len(tok.apply_chat_template(MSGS, tools=TOOLS, add_generation_prompt=True))
    assert r.choices[0].finish_reason == "tool_calls"
    check_call(r.choices[0].message.tool_calls[0])
    history = MSGS + [r.choices[0].message.model_dump(exclude_none=True),
                      {"role": "tool", "tool_call_id": r.choices[0].message.tool_calls[0].id, "content": "21"}]
    again = client.chat.completions.create(model="tiny", messages=history, tools=TOOLS, temperature=0, max_tokens=4)
    assert again.usage.prompt_tokens == len(tok.apply_chat_template(
        [{**m, "tool_calls": [{**c, "function": {**c["function"], "arguments": json.loads(c["function"]["arguments"])}}
                              for c in m.get("tool_calls", [])]} if m.get("tool_calls") else m for m in history],
        tools=TOOLS, add_generation_prompt=True))


# --- agent frameworks, as users point them at a local server ------------------------------
class City(BaseModel):  # bounded fields: a random-weight model must finish within max_tokens
    name: str = Field(max_length=8)
    population: int = Field(ge=0, le=1000)


def test_langchain_bind_tools_and_structured_output(base):
    """LangChain over chat completions: a forced call, its ToolMessage back, and
    with_structured_output (json_schema)."""
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def get_weather(city: Literal["Paris", "Rome"]) -> str:
        """Weather in a city."""
        return f"sunny in {city}"

    llm = ChatOpenAI(base_url=f"{base}/v1", api_key="unused", model="tiny", temperature=0, max_tokens=64,
                     max_retries=0)
    msg = llm.bind_tools([get_weather], tool_choice="required").invoke("Weather in Paris?")
    assert len(msg.tool_calls) == 1 and msg.tool_calls[0]["name"] == "get_weather"
    assert msg.tool_calls[0]["args"]["city"] in ("Paris", "Rome")
    follow = llm.bind_tools([get_weather]).invoke(
        ["Weather in Paris?", msg, get_weather.invoke(msg.tool_calls[0])])  # the tool's ToolMessage
    assert follow.usage_metadata["input_tokens"] > msg.usage_metadata["input_tokens"]
    city = llm.with_structured_output(City, method="json_schema").invoke("Describe a city.")
    assert isinstance(city, City)


def test_openai_agents_sdk_calls_a_tool_through_the_responses_api(base):
    """The OpenAI Agents SDK over the Responses API: the tool is called and its output ends the run."""
    from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled
    from openai import AsyncOpenAI

    set_tracing_disabled(True)
    calls = []

    @function_tool
    def get_weather(city: Literal["Paris", "Rome"]) -> str:
        """Weather in a city."""
        calls.append(city)
        return json.dumps({"city": city, "sky": "sunny"})

    model = OpenAIResponsesModel(model="tiny", openai_client=AsyncOpenAI(base_url=f"{base}/v1", api_key="unused"))
    agent = Agent(name="weather", instructions="Answer with the weather tool.", model=model, tools=[get_weather],
                  model_settings=ModelSettings(tool_choice="required", temperature=0, max_tokens=64),
                  tool_use_behavior="stop_on_first_tool")
    result = Runner.run_sync(agent, "Weather in Paris?")
    assert len(calls) == 1 and json.loads(result.final_output) == {"city": calls[0], "sky": "sunny"}

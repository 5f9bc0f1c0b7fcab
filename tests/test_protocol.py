"""serve_app.api.protocol: request validation, request -> SamplingParams, and responses the
official `openai` client parses (model_validate and a real client over a mock transport)."""

import json

import httpx
import openai
import pytest
from openai.types import Completion as OAICompletion, Model as OAIModel
from openai.types.chat import ChatCompletion as OAIChatCompletion, ChatCompletionChunk as OAIChatCompletionChunk
from pydantic import ValidationError

from mlx_worker.sampling.grammar import GrammarSpec
from mlx_worker.request import RequestOutput
from serve_app.api.protocol import (
    ChatCompletionChunk,
    ChatCompletionRequest,
    CompletionRequest,
    ModelCard,
    ModelList,
    ProtocolError,
    chat_chunk,
    chat_completion,
    chat_logprobs,
    completion,
    completion_chunk,
    completion_logprobs,
    error_body,
    merge_outputs,
    parse_request,
    to_sampling_params,
    usage,
)

MSGS = [{"role": "user", "content": "hi"}]


def chat(**kw):
    return parse_request(ChatCompletionRequest, {"messages": MSGS, **kw})


def cmpl(**kw):
    return parse_request(CompletionRequest, {"prompt": "hello", **kw})


def params(req, default_max_tokens=100, **kw):
    return to_sampling_params(req, default_max_tokens, **kw)


def decode(t):
    return "abcdefghijklmnopqrstuvwxyz"[t % 26]


def err(fn) -> ProtocolError:
    with pytest.raises(ProtocolError) as e:
        fn()
    assert e.value.status == 400
    return e.value


# --- validation -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "body, param, words",
    [
        ({"top_p": 0}, "top_p", "greater than 0"),
        ({"max_tokens": -5}, "max_tokens", "greater than or equal to 1"),
        ({"max_completion_tokens": 0}, "max_completion_tokens", "greater than or equal to 1"),
        ({"n": 1000}, "n", "less than or equal to 16"),
        ({"temperature": 3}, "temperature", "less than or equal to 2"),
        ({"top_logprobs": 50, "logprobs": True}, "top_logprobs", "less than or equal to 20"),
        ({"top_logprobs": 2}, "top_logprobs", "requires logprobs"),
        ({"logit_bias": {"50": 500}}, "logit_bias", "[-100, 100]"),
        ({"stop": ""}, "stop", "non-empty"),
        ({"guided_regex": "a+", "guided_choice": ["x"]}, "guided_choice", "only one of"),
        ({"response_format": {"type": "json_object"}, "guided_json": {"type": "object"}}, "guided_json", "only one of"),
        ({"guided_choice": []}, "guided_choice", "at least 1"),
    ],
)
def test_bad_sampling_values(body, param, words):
    e = err(lambda: params(chat(**body)))
    assert e.param == param and words in e.message and param in e.message, e.message


@pytest.mark.parametrize(
    "body, param, words",
    [
        ({"logit_bias": {"abc": 1.0}}, "logit_bias", "token ids"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role", "'user'"),
        ({"messages": []}, "messages", "at least 1"),
        ({"messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": ""}}]}]},
         "messages[0].content", "'input_audio' is not supported"),
        ({"messages": [{"role": "assistant", "content": [{"type": "image_url", "image_url": {"url": "data:"}}]}]},
         "messages[0]", "only user messages may hold images"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
         "messages[0]", "an image_url part needs"),
        ({"messages": [{"role": "user"}]}, "messages[0]", "needs content"),
        ({"response_format": {"type": "xml"}}, "response_format.type", "'json_schema'"),
        ({"response_format": {"type": "json_schema"}}, "response_format", "json_schema"),
        ({"temperature": "hot"}, "temperature", "valid number"),
        ({"n": "two"}, "n", "valid integer"),
        ({"stream": "maybe"}, "stream", "valid boolean"),
        ({"stop": [1, 2]}, "stop[0]", "valid string"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}],
          "tool_choice": {"type": "function", "function": {"name": "g"}}}, None, "'g', which is not among the tools"),
        ({"tool_choice": "required"}, None, "tool_choice needs tools"),
        ({"tools": [{"type": "retrieval"}]}, "tools[0].type", "'function'"),
        ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools[0].function.name", "pattern"),
        ({"messages": [{"role": "user", "content": "x"}, {"role": "tool", "content": "42", "tool_call_id": "nope"}]},
         None, "'nope', which no assistant message called"),
        ({"messages": [{"role": "tool", "content": "42"}]}, "messages[0]", "needs the tool_call_id"),
        ({"guided_json": "{bad"}, "guided_json", "not valid JSON"),
    ],
)
def test_bad_chat_requests(body, param, words):
    e = err(lambda: chat(**body))
    assert e.param == param and words in e.message, e.message
    with pytest.raises(ValidationError):  # the models themselves raise pydantic's error
        ChatCompletionRequest.model_validate({"messages": MSGS, **body})


def test_missing_messages_and_bad_json():
    assert "messages: Field required" in err(lambda: parse_request(ChatCompletionRequest, {})).message
    assert "Invalid JSON" in err(lambda: parse_request(ChatCompletionRequest, b"{nope")).message


@pytest.mark.parametrize(
    "body, param, words",
    [
        ({"suffix": "tail"}, "suffix", "not supported"),
        ({"prompt": ["a", "b"]}, "prompt", "batched prompts"),
        ({"prompt": [1, "b"]}, "prompt", "token ids"),
        ({"prompt": [1, -2]}, "prompt", "token ids"),
        ({"prompt": ""}, "prompt", "empty"),
        ({"prompt": []}, "prompt", "empty"),
        ({"prompt": 5}, "prompt", "string or a list"),
    ],
)
def test_bad_completion_requests(body, param, words):
    e = err(lambda: cmpl(**body))
    assert e.param == param and words in e.message, e.message


def test_completion_logprobs_range_names_the_request_field():
    e = err(lambda: params(cmpl(logprobs=21)))
    assert e.param == "logprobs" and e.message.startswith("logprobs:")


def test_unknown_fields_are_ignored():
    req = chat(user="u1", service_tier="auto", parallel_tool_calls=False, metadata={"a": "b"})
    assert params(req).max_tokens == 100


# --- conversions ------------------------------------------------------------------------------


def test_defaults():
    p = params(chat(), default_max_tokens=77)
    assert (p.max_tokens, p.temperature, p.top_p, p.n, p.logprobs, p.structured) == (77, 1.0, 1.0, 1, False, None)
    assert params(cmpl()).max_tokens == 16  # OpenAI's completions default
    assert params(cmpl(max_tokens=None), default_max_tokens=50).max_tokens == 50
    assert params(chat(temperature=None, top_p=None)).temperature == 1.0  # explicit nulls: defaults


def test_max_completion_tokens_wins():
    assert params(chat(max_tokens=10, max_completion_tokens=20)).max_tokens == 20
    assert params(chat(max_tokens=10)).max_tokens == 10


def test_context_length():
    assert params(chat(), 100, max_model_len=50, num_prompt_tokens=10).max_tokens == 40  # default shrinks to fit
    assert params(chat(max_tokens=40), 100, max_model_len=50, num_prompt_tokens=10).max_tokens == 40
    e = err(lambda: params(chat(max_completion_tokens=41), 100, max_model_len=50, num_prompt_tokens=10))
    assert (e.code, e.param) == ("context_length_exceeded", "max_completion_tokens") and "50 tokens" in e.message
    e = err(lambda: params(cmpl(), 100, max_model_len=50, num_prompt_tokens=50))
    assert (e.code, e.param) == ("context_length_exceeded", "prompt")


def test_field_mapping():
    p = params(chat(stop="###", stop_token_ids=[7], logit_bias={"5": -100, "9": 2.5}, seed=3, top_k=-1, min_p=0.1,
                    repetition_penalty=1.1, presence_penalty=0.5, frequency_penalty=-0.5, min_tokens=2, ignore_eos=True,
                    n=3, logprobs=True, top_logprobs=4))
    assert p.stop == ["###"] and p.stop_token_ids == [7] and p.logit_bias == {5: -100.0, 9: 2.5}
    assert (p.seed, p.top_k, p.min_p) == (3, 0, 0.1)
    assert (p.repetition_penalty, p.presence_penalty, p.frequency_penalty) == (1.1, 0.5, -0.5)
    assert (p.min_tokens, p.ignore_eos, p.n, p.logprobs, p.top_logprobs) == (2, True, 3, True, 4)
    assert params(chat(stop=["a", "b"])).stop == ["a", "b"]
    assert 0 <= params(chat(seed=-1)).seed < 2**32 - 16  # any int64 seed fits the engine's uint32


def test_completion_prompts_and_logprobs():
    assert cmpl(prompt=["one prompt"]).prompt == "one prompt"
    assert cmpl(prompt=[1, 2, 3]).prompt == [1, 2, 3]
    assert cmpl(prompt=[[4, 5]]).prompt == [4, 5]
    p = params(cmpl(logprobs=3))
    assert (p.logprobs, p.top_logprobs) == (True, 3)
    p = params(cmpl(logprobs=0))
    assert (p.logprobs, p.top_logprobs) == (True, 0)
    assert params(cmpl()).logprobs is False
    assert params(cmpl(suffix="")).max_tokens == 16


def test_structured_outputs():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    rf = {"type": "json_schema", "json_schema": {"name": "thing", "schema": schema, "strict": True}}
    assert params(chat(response_format=rf)).structured == GrammarSpec(json_schema=schema)
    no_schema = {"type": "json_schema", "json_schema": {"name": "x"}}
    assert params(chat(response_format=no_schema)).structured == GrammarSpec(json_object=True)
    assert params(chat(response_format={"type": "json_object"})).structured == GrammarSpec(json_object=True)
    assert params(chat(response_format={"type": "text"})).structured is None
    assert params(chat(guided_regex=r"\d+")).structured == GrammarSpec(regex=r"\d+")
    assert params(cmpl(guided_choice=["yes", "no"])).structured == GrammarSpec(choice=["yes", "no"])
    assert params(chat(guided_json=json.dumps(schema))).structured == GrammarSpec(json_schema=schema)


def test_chat_messages():
    req = chat(messages=[{"role": "developer", "content": "be brief"},
                         {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                         {"role": "assistant", "content": None, "tool_calls": [
                             {"id": "x", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}]},
                         {"role": "tool", "content": "42", "tool_call_id": "x"}])
    assert req.chat_messages() == [
        {"role": "system", "content": "be brief"}, {"role": "user", "content": "a\nb"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "x", "type": "function", "function": {"name": "f", "arguments": {"a": 1}}}]},
        {"role": "tool", "content": "42", "tool_call_id": "x"}]


def test_include_usage():
    assert chat(stream=True, stream_options={"include_usage": True}).include_usage
    assert not chat(stream=False, stream_options={"include_usage": True}).include_usage
    assert not chat(stream=True).include_usage


# --- responses --------------------------------------------------------------------------------


def out(index=0, toks=(1, 2), text="bc", finished=False, reason=None, logprobs=True, top=2):
    lps = [-0.5 * (i + 1) for i in range(len(toks))] if logprobs else None
    tops = [[(t, -0.1), (t + 1, -2.0)][:top] for t in toks] if logprobs and top else None
    return RequestOutput(rid="r", token_ids=list(toks), finished=finished, finish_reason=reason, logprobs=lps,
                         top_logprobs=tops, index=index, text=text, num_prompt_tokens=5, num_cached_tokens=3,
                         num_output_tokens=len(toks))


def stream(reason="stop"):
    """Outputs of an n=2 request, interleaved; counts as the engine sends them."""
    a1, b1 = out(0, (1,), "b"), out(1, (3,), "d")
    a2, b2 = out(0, (2,), "c", True, reason), out(1, (4,), "e", True, "length")
    a2.num_output_tokens, b2.num_output_tokens = 2, 2
    return [a1, b1, a2, b2]


def test_merge_and_usage():
    m = merge_outputs(stream())
    assert [(o.index, o.token_ids, o.text, o.finish_reason, o.logprobs) for o in m] == [
        (0, [1, 2], "bc", "stop", [-0.5, -0.5]), (1, [3, 4], "de", "length", [-0.5, -0.5])]
    u = usage(stream())
    assert (u.prompt_tokens, u.completion_tokens, u.total_tokens, u.prompt_tokens_details.cached_tokens) == (5, 4, 9, 3)


def test_chat_completion_parses_with_openai():
    resp = chat_completion(stream("abort"), "smollm", decode)
    o = OAIChatCompletion.model_validate(json.loads(resp.model_dump_json()))
    assert o.id.startswith("chatcmpl-") and o.object == "chat.completion" and o.model == "smollm"
    assert [(c.index, c.message.role, c.message.content, c.finish_reason) for c in o.choices] == [
        (0, "assistant", "bc", "stop"), (1, "assistant", "de", "length")]
    lp = o.choices[0].logprobs.content
    assert [(t.token, t.logprob, t.bytes) for t in lp] == [("b", -0.5, [98]), ("c", -0.5, [99])]
    assert [(t.token, t.logprob) for t in lp[0].top_logprobs] == [("b", -0.1), ("c", -2.0)]
    assert (o.usage.prompt_tokens, o.usage.completion_tokens, o.usage.total_tokens) == (5, 4, 9)
    assert o.usage.prompt_tokens_details.cached_tokens == 3
    no_lp = chat_completion([out(logprobs=False, finished=True, reason="stop")], "m", decode)
    assert OAIChatCompletion.model_validate(no_lp.model_dump()).choices[0].logprobs is None


def test_chat_chunks_parse_with_openai():
    first = chat_chunk(out(toks=(1,), text="b"), "chatcmpl-1", 123, "m", decode, first=True)
    mid = chat_chunk(out(toks=(2,), text="", logprobs=False), "chatcmpl-1", 123, "m")
    last = chat_chunk(out(toks=(3,), text="d", finished=True, reason="length"), "chatcmpl-1", 123, "m", decode)
    tail = ChatCompletionChunk(id="chatcmpl-1", created=123, model="m", usage=usage(stream()))
    j = [json.loads(c.model_dump_json()) for c in (first, mid, last, tail)]
    assert j[0]["choices"][0]["delta"] == {"role": "assistant", "content": "b"}
    assert j[1]["choices"][0]["delta"] == {} and j[1]["usage"] is None
    assert j[3]["choices"] == [] and j[3]["usage"]["total_tokens"] == 9
    o = [OAIChatCompletionChunk.model_validate(x) for x in j]
    assert all(c.object == "chat.completion.chunk" and c.id == "chatcmpl-1" for c in o)
    assert o[0].choices[0].delta.role == "assistant" and o[0].choices[0].finish_reason is None
    assert o[2].choices[0].finish_reason == "length" and o[2].choices[0].logprobs.content[0].token == "d"


def test_completion_parses_with_openai():
    resp = completion(stream(), "m", decode)
    o = OAICompletion.model_validate(json.loads(resp.model_dump_json()))
    assert o.id.startswith("cmpl-") and o.object == "text_completion"
    c = o.choices[0]
    assert (c.text, c.finish_reason) == ("bc", "stop")
    assert (c.logprobs.tokens, c.logprobs.token_logprobs, c.logprobs.text_offset) == (["b", "c"], [-0.5, -0.5], [0, 1])
    assert c.logprobs.top_logprobs == [{"b": -0.1, "c": -2.0}, {"c": -0.1, "d": -2.0}]
    assert o.usage.total_tokens == 9
    last = out(toks=(4,), text="e", finished=True, reason="length")
    last = completion_chunk(last, "cmpl-1", 1, "m", decode, text_offset=7)
    o = OAICompletion.model_validate(json.loads(last.model_dump_json()))
    assert o.choices[0].finish_reason == "length" and o.choices[0].logprobs.text_offset == [7]
    mid = completion_chunk(out(toks=(4,), text="e"), "cmpl-1", 1, "m")
    assert json.loads(mid.model_dump_json())["choices"][0]["finish_reason"] is None  # as OpenAI streams it


def test_logprob_helpers():
    lp = chat_logprobs([1], [float("-inf")], [[(1, float("-inf"))]], lambda t: b"\xe2\x82")  # partial UTF-8
    choice = {"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": ""},
              "logprobs": lp.model_dump()}
    t = OAIChatCompletion.model_validate({"id": "x", "object": "chat.completion", "created": 0, "model": "m",
                                          "choices": [choice]})
    tok = t.choices[0].logprobs.content[0]
    assert tok.bytes == [0xE2, 0x82] and tok.logprob == -9999.0 and tok.top_logprobs[0].logprob == -9999.0
    c = completion_logprobs([0, 1, 2], [-1.0, -2.0, -3.0], None, lambda t: ["ab", "", "c"][t], text_offset=10)
    assert (c.tokens, c.text_offset, c.top_logprobs) == (["ab", "", "c"], [10, 12, 12], None)


def test_models_and_errors():
    card = ModelCard(id="smollm", max_model_len=2048)
    assert OAIModel.model_validate(card.model_dump()).owned_by == "macfarm"
    assert ModelList(data=[card]).model_dump()["object"] == "list"
    assert error_body(400, "bad", "top_p") == {
        "error": {"message": "bad", "type": "invalid_request_error", "param": "top_p", "code": None}}
    assert [error_body(s, "x")["error"]["type"] for s in (401, 404, 422, 429, 500, 503)] == [
        "authentication_error", "invalid_request_error", "invalid_request_error", "rate_limit_error", "server_error",
        "service_unavailable"]
    e = err(lambda: params(chat(top_p=0)))
    assert e.body()["error"] == {"message": "top_p: Input should be greater than 0", "type": "invalid_request_error",
                                 "param": "top_p", "code": None}


# --- the official client over a mock transport ------------------------------------------------


def mock_client():
    """An openai.OpenAI whose server is these helpers (no network, no engine)."""
    seen = []

    def handle(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        cls = ChatCompletionRequest if request.url.path.endswith("/chat/completions") else CompletionRequest
        try:
            req = parse_request(cls, body)
            seen.append((req, to_sampling_params(req, 64)))
        except ProtocolError as e:
            return httpx.Response(e.status, json=e.body())
        outs = stream()
        if cls is CompletionRequest:
            return httpx.Response(200, json=completion(outs, "m", decode).model_dump())
        if not req.stream:
            return httpx.Response(200, json=chat_completion(outs, "m", decode if req.logprobs else None).model_dump())
        chunks = [chat_chunk(o, "chatcmpl-s", 1, "m", first=i < 2) for i, o in enumerate(outs)]
        if req.include_usage:
            chunks.append(ChatCompletionChunk(id="chatcmpl-s", created=1, model="m", usage=usage(outs)))
        sse = "".join(f"data: {c.model_dump_json()}\n\n" for c in chunks) + "data: [DONE]\n\n"
        return httpx.Response(200, content=sse.encode(), headers={"content-type": "text/event-stream"})

    client = openai.OpenAI(api_key="x", base_url="http://test/v1", max_retries=0,
                           http_client=httpx.Client(transport=httpx.MockTransport(handle)))
    return client, seen


def test_openai_client_round_trip():
    client, seen = mock_client()
    rf = {"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "object"}}}
    r = client.chat.completions.create(model="m", messages=MSGS, max_completion_tokens=9, logprobs=True, top_logprobs=2,
                                       response_format=rf)
    assert r.choices[1].message.content == "de" and r.choices[0].logprobs.content[1].token == "c"
    p = seen[-1][1]
    assert (p.max_tokens, p.top_logprobs, p.structured) == (9, 2, GrammarSpec(json_schema={"type": "object"}))

    pieces = list(client.chat.completions.create(model="m", messages=MSGS, stream=True,
                                                 stream_options={"include_usage": True}))
    text = {0: "", 1: ""}
    for c in pieces[:-1]:
        text[c.choices[0].index] += c.choices[0].delta.content or ""
    assert text == {0: "bc", 1: "de"} and pieces[-1].usage.completion_tokens == 4

    c = client.completions.create(model="m", prompt="hi", logprobs=2, seed=1)
    assert c.choices[0].text == "bc" and c.choices[0].logprobs.tokens == ["b", "c"] and seen[-1][1].top_logprobs == 2

    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="m", messages=MSGS, top_p=0)
    assert e.value.status_code == 400 and e.value.body["param"] == "top_p"
    assert "greater than 0" in e.value.body["message"]

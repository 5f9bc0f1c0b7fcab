"""The OpenAI HTTP API as pydantic models (chat completions, completions, models, errors)
and pure conversions: request -> engine SamplingParams, engine RequestOutputs -> responses."""

import json
import time
import uuid
from dataclasses import replace
from typing import Any, Callable, Dict, Iterable, List, Literal, Optional, Tuple, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_serializer, model_validator

from mlx_worker.grammar import GrammarSpec
from mlx_worker.request import RequestOutput
from mlx_worker.sampling import MAX_N, SamplingParams

from .tools import Tool, ToolCall, ToolChoice

# --- errors ---------------------------------------------------------------------------


def error_type(status: int) -> str:
    """OpenAI's error `type` for an HTTP status."""
    if status == 401:
        return "authentication_error"
    if status == 403:
        return "permission_error"
    if status == 429:
        return "rate_limit_error"
    if status == 503:
        return "service_unavailable"
    return "server_error" if status >= 500 else "invalid_request_error"


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: Optional[str] = None
    code: Optional[Union[str, int]] = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


def error_body(status: int, message: str, param: Optional[str] = None, code: Optional[Union[str, int]] = None) -> dict:
    """The JSON body of an error response: {"error": {message, type, param, code}}."""
    return {"error": {"message": message, "type": error_type(status), "param": param, "code": code}}


class ProtocolError(ValueError):
    """A request the API rejects; `body()` is the JSON to send with `status`."""

    def __init__(self, message: str, param: Optional[str] = None, code: Optional[Union[str, int]] = None,
                 status: int = 400):
        super().__init__(message)
        self.message, self.param, self.code, self.status = message, param, code, status

    def body(self) -> dict:
        return error_body(self.status, self.message, self.param, self.code)

    @classmethod
    def from_validation(cls, e: ValidationError, rename: Optional[Dict[str, str]] = None) -> "ProtocolError":
        """Readable message ("top_p: Input should be greater than 0"); `rename` maps the
        first path element (an engine field) to the request field it came from."""
        msgs, params = [], []
        for err in e.errors(include_url=False):
            loc = list(err["loc"])
            if loc and rename:
                loc[0] = rename.get(loc[0], loc[0])
            where = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc).lstrip(".")  # messages[0].role
            msg = err["msg"].removeprefix("Value error, ")
            msgs.append(f"{where}: {msg}" if where else msg)
            params.append(where)
        return cls("; ".join(dict.fromkeys(msgs)), param=next((p for p in params if p), None))


def parse_request(cls: type, data: Union[dict, str, bytes]):
    """`cls` (a request model) from a JSON body or dict; `ProtocolError` if invalid."""
    try:
        return cls.model_validate_json(data) if isinstance(data, (str, bytes)) else cls.model_validate(data)
    except ValidationError as e:
        raise ProtocolError.from_validation(e) from None


# --- requests ---------------------------------------------------------------------------


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: Optional[bool] = False


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)
    name: Optional[str] = None
    description: Optional[str] = None
    schema_: Optional[Dict[str, Any]] = Field(None, alias="schema")  # `schema` shadows BaseModel.schema
    strict: Optional[bool] = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[JsonSchemaFormat] = None

    @model_validator(mode="after")
    def _schema_given(self):
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError('type "json_schema" needs a "json_schema" object')
        return self


class _Request(BaseModel):
    """Fields shared by chat and text completions."""

    model_config = ConfigDict(extra="ignore")  # OpenAI clients send extras; wrong types still fail

    model: Optional[str] = None
    temperature: Optional[float] = 1.0
    top_p: Optional[float] = 1.0
    top_k: Optional[int] = None  # vLLM: -1 or 0 is off
    min_p: Optional[float] = None
    seed: Optional[int] = None
    max_tokens: Optional[int] = None
    min_tokens: Optional[int] = None
    stop: Optional[List[str]] = None
    stop_token_ids: Optional[List[int]] = None
    ignore_eos: Optional[bool] = None
    repetition_penalty: Optional[float] = None
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    logit_bias: Optional[Dict[int, float]] = None
    n: Optional[int] = 1
    stream: Optional[bool] = False
    stream_options: Optional[StreamOptions] = None
    response_format: Optional[ResponseFormat] = None
    guided_json: Optional[Dict[str, Any]] = None
    guided_regex: Optional[str] = None
    guided_choice: Optional[List[str]] = Field(None, min_length=1)
    user: Optional[str] = None  # ignored

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_list(cls, v):
        return [v] if isinstance(v, str) else v

    @field_validator("logit_bias", mode="before")
    @classmethod
    def _bias_keys(cls, v):
        if not isinstance(v, dict):
            return v
        for k in v:
            if not (isinstance(k, int) or (isinstance(k, str) and k.strip().lstrip("-").isdigit())):
                raise ValueError(f"keys must be token ids (integers), got {k!r}")
        return {int(k): b for k, b in v.items()}

    @field_validator("guided_json", mode="before")
    @classmethod
    def _json_text(cls, v):
        if isinstance(v, str):
            try:
                return json.loads(v)
            except json.JSONDecodeError as e:
                raise ValueError(f"not valid JSON: {e}") from None
        return v

    @property
    def include_usage(self) -> bool:
        """Stream a final chunk with usage (stream_options.include_usage)."""
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


class Message(BaseModel):
    """A chat message; content is text (a list of text parts is joined with newlines)."""

    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: Optional[str] = None
    name: Optional[str] = None
    tool_calls: Optional[List[ToolCall]] = None  # an assistant's earlier calls
    tool_call_id: Optional[str] = None  # a tool message: the call it answers

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts(cls, v):
        if not isinstance(v, list):
            return v
        texts = []
        for p in v:
            kind = p.get("type") if isinstance(p, dict) else type(p).__name__
            if kind != "text":
                raise ValueError(f"content part type {kind!r} is not supported: only text parts")
            if not isinstance(p.get("text"), str):
                raise ValueError('a text content part needs a string "text"')
            texts.append(p["text"])
        return "\n".join(texts)

    @model_validator(mode="after")
    def _has_content(self):
        if self.content is None and self.role != "assistant":
            raise ValueError(f"a {self.role} message needs content")
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a tool message needs the tool_call_id of the call it answers")
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        return self

    def template_dict(self) -> Dict[str, Any]:
        """The message as chat templates take it (developer -> system; a call's
        arguments as an object, as HF templates render them)."""
        m: Dict[str, Any] = {"role": "system" if self.role == "developer" else self.role, "content": self.content or ""}
        if self.tool_calls:
            m["tool_calls"] = [{"id": c.id, "type": "function",
                                "function": {"name": c.function.name, "arguments": _json_or_text(c.function.arguments)}}
                               for c in self.tool_calls]
        if self.tool_call_id:
            m["tool_call_id"] = self.tool_call_id
        if self.name:
            m["name"] = self.name
        return m


class ChatCompletionRequest(_Request):
    """POST /v1/chat/completions."""

    messages: List[Message] = Field(min_length=1)
    max_completion_tokens: Optional[int] = None  # newer name of max_tokens; wins over it
    logprobs: Optional[bool] = False
    top_logprobs: Optional[int] = None
    tools: Optional[List[Tool]] = None
    tool_choice: Optional[ToolChoice] = None  # default: "auto" with tools, else "none"
    parallel_tool_calls: Optional[bool] = None

    @model_validator(mode="after")
    def _tools_consistent(self):
        choice = self.tool_choice
        if choice not in (None, "none") and not self.tools:
            raise ValueError("tool_choice needs tools")
        if self.tools:
            names = [t.function.name for t in self.tools]
            if len(set(names)) != len(names):
                raise ValueError("tools must have distinct function names")
            if isinstance(choice, BaseModel) and choice.function.name not in names:
                raise ValueError(f"tool_choice names {choice.function.name!r}, which is not among the tools")
        calls = {c.id for m in self.messages for c in m.tool_calls or []}
        for m in self.messages:
            if m.role == "tool" and m.tool_call_id not in calls:
                raise ValueError(f"tool message answers tool_call_id {m.tool_call_id!r}, which no assistant "
                                 "message called")
        if (self.tools and self.effective_tool_choice != "none") and self.n and self.n > 1:
            raise ValueError("n > 1 with tools is not supported")
        return self

    @property
    def effective_tool_choice(self) -> ToolChoice:
        return self.tool_choice or ("auto" if self.tools else "none")

    def chat_messages(self) -> List[Dict[str, Any]]:
        """Messages for `tokenizer.apply_chat_template`."""
        return [m.template_dict() for m in self.messages]


class CompletionRequest(_Request):
    """POST /v1/completions: one prompt, text or token ids."""

    prompt: Union[str, List[int]]
    max_tokens: Optional[int] = 16
    logprobs: Optional[int] = None  # k: the sampled token's logprob plus the top k
    echo: Optional[bool] = False
    suffix: Optional[str] = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_prompt(cls, v):
        if isinstance(v, list) and v and all(isinstance(p, (str, list)) for p in v):
            if len(v) > 1:
                raise ValueError("batched prompts are not supported: send one prompt per request")
            v = v[0]
        if isinstance(v, list) and not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in v):
            raise ValueError("must be a string or a list of token ids (non-negative integers)")
        if not isinstance(v, (str, list)):
            raise ValueError("must be a string or a list of token ids")
        if not v:
            raise ValueError("must not be empty")
        return v

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, v):
        if v:
            raise ValueError("not supported")
        return v

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, v):
        if v:
            raise ValueError("not supported")
        return v


# --- request -> engine --------------------------------------------------------------------

AnyRequest = Union[ChatCompletionRequest, CompletionRequest]
_PASSTHROUGH = ("temperature", "top_p", "min_p", "min_tokens", "stop", "stop_token_ids", "ignore_eos",
                "repetition_penalty", "presence_penalty", "frequency_penalty", "logit_bias", "n")


def grammar_spec(req: AnyRequest) -> Optional[GrammarSpec]:
    """The output constraint of response_format / guided_*; at most one may be given."""
    got = {}
    rf = req.response_format
    if rf is not None and rf.type != "text":
        schema = rf.json_schema.schema_ if rf.type == "json_schema" else None
        got["response_format"] = {"json_schema": schema} if schema is not None else {"json_object": True}
    if req.guided_json is not None:
        got["guided_json"] = {"json_schema": req.guided_json}
    if req.guided_regex is not None:
        got["guided_regex"] = {"regex": req.guided_regex}
    if req.guided_choice is not None:
        got["guided_choice"] = {"choice": req.guided_choice}
    if len(got) > 1:
        raise ProtocolError(f"only one of {', '.join(got)} may be given: each constrains the whole output",
                            param=list(got)[1])
    if not got:
        return None
    (name, spec), = got.items()
    try:
        return GrammarSpec(**spec)
    except ValidationError as e:
        raise ProtocolError(f"{name}: {e.errors()[0]['msg'].removeprefix('Value error, ')}", param=name) from None


def to_sampling_params(req: AnyRequest, default_max_tokens: int, max_model_len: Optional[int] = None,
                       num_prompt_tokens: int = 0, tool_grammar: Optional[GrammarSpec] = None) -> SamplingParams:
    """The engine's SamplingParams for a chat or text completion request.

    max_tokens: max_completion_tokens, else max_tokens, else `default_max_tokens`; with
    `max_model_len`, prompt + max_tokens must fit (a default is shrunk to fit).
    Raises `ProtocolError` (400) for anything invalid.
    """
    chat = isinstance(req, ChatCompletionRequest)
    rename: Dict[str, str] = {}
    max_tokens = req.max_tokens
    if chat and req.max_completion_tokens is not None:
        max_tokens, rename["max_tokens"] = req.max_completion_tokens, "max_completion_tokens"
    if max_model_len is not None:
        room = max_model_len - num_prompt_tokens
        limit = f"This model's maximum context length is {max_model_len} tokens"
        if room < 1:
            raise ProtocolError(f"{limit}, but the prompt has {num_prompt_tokens} tokens",
                                param="messages" if chat else "prompt", code="context_length_exceeded")
        if max_tokens is not None and max_tokens > room:
            raise ProtocolError(f"{limit}, but you requested {num_prompt_tokens + max_tokens} ({num_prompt_tokens} in "
                                f"the prompt, {max_tokens} in the completion); reduce the prompt or max_tokens",
                                param=rename.get("max_tokens", "max_tokens"), code="context_length_exceeded")
        if max_tokens is None:
            max_tokens = min(default_max_tokens, room)
    kw = {k: getattr(req, k) for k in _PASSTHROUGH if getattr(req, k) is not None}
    kw["max_tokens"] = default_max_tokens if max_tokens is None else max_tokens
    if req.top_k is not None:
        kw["top_k"] = 0 if req.top_k == -1 else req.top_k  # vLLM's -1: off
    if req.seed is not None:
        kw["seed"] = req.seed % (2**32 - MAX_N)  # any int64 -> the engine's uint32 (+ sample index)
    if chat:
        if req.top_logprobs and not req.logprobs:
            raise ProtocolError("top_logprobs requires logprobs to be true", param="top_logprobs")
        kw.update(logprobs=bool(req.logprobs), top_logprobs=req.top_logprobs or 0)
    elif req.logprobs is not None:
        kw.update(logprobs=True, top_logprobs=req.logprobs)
        rename["top_logprobs"] = "logprobs"
    kw["structured"] = grammar_spec(req)
    if tool_grammar is not None:
        if kw["structured"] is not None:
            raise ProtocolError("tool_choice 'required' or a named function constrains the whole output: "
                                "it cannot be combined with response_format or guided_*", param="tool_choice")
        kw["structured"] = tool_grammar
    try:
        return SamplingParams(**kw)
    except ValidationError as e:
        raise ProtocolError.from_validation(e, rename) from None


# --- responses -------------------------------------------------------------------------------


def _json_or_text(s: str):
    try:
        return json.loads(s)
    except (TypeError, ValueError):
        return s


def random_id(prefix: str) -> str:
    """e.g. random_id("chatcmpl") -> "chatcmpl-3f2a..."."""
    return f"{prefix}-{uuid.uuid4().hex}"


def _now() -> int:
    return int(time.time())


FinishReason = Literal["stop", "length", "tool_calls"]


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: Optional[List[int]] = None


class TokenLogprob(TopLogprob):
    top_logprobs: List[TopLogprob] = Field(default_factory=list)


class ChoiceLogprobs(BaseModel):
    content: Optional[List[TokenLogprob]] = None


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: Optional[PromptTokensDetails] = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: Optional[str] = None
    tool_calls: Optional[List[ToolCall]] = None

    @model_serializer(mode="wrap")
    def _drop_no_calls(self, handler):
        d = handler(self)
        if d.get("tool_calls") is None:
            d.pop("tool_calls", None)
        return d


class ToolCallDelta(ToolCall):
    index: int


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    finish_reason: FinishReason
    logprobs: Optional[ChoiceLogprobs] = None


class ChatCompletion(BaseModel):
    id: str = Field(default_factory=lambda: random_id("chatcmpl"))
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: List[ChatChoice]
    usage: Optional[Usage] = None


class Delta(BaseModel):
    role: Optional[Literal["assistant"]] = None
    content: Optional[str] = None
    tool_calls: Optional[List[ToolCallDelta]] = None

    @model_serializer(mode="wrap")
    def _drop_none(self, handler):  # OpenAI sends {"content": "x"}, and {} at the end
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatChunkChoice(BaseModel):
    index: int
    delta: Delta
    finish_reason: Optional[FinishReason] = None
    logprobs: Optional[ChoiceLogprobs] = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=_now)
    model: str
    choices: List[ChatChunkChoice] = Field(default_factory=list)
    usage: Optional[Usage] = None


class CompletionLogprobs(BaseModel):
    tokens: List[str]
    token_logprobs: List[float]
    top_logprobs: Optional[List[Dict[str, float]]] = None
    text_offset: List[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    finish_reason: Optional[FinishReason] = None  # null in streamed chunks until the last
    logprobs: Optional[CompletionLogprobs] = None


class Completion(BaseModel):
    id: str = Field(default_factory=lambda: random_id("cmpl"))
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: List[CompletionChoice]
    usage: Optional[Usage] = None


CompletionChunk = Completion  # OpenAI streams text completions as the same object


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=_now)
    owned_by: str = "macfarm"
    max_model_len: Optional[int] = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: List[ModelCard] = Field(default_factory=list)


# --- engine outputs -> responses --------------------------------------------------------------

# token id -> its text (or its raw bytes), e.g. `lambda t: tokenizer.decode([t])`
Decode = Callable[[int], Union[str, bytes]]


def _tok(decode: Decode, cache: dict, tid: int) -> Tuple[str, List[int]]:
    if tid not in cache:
        t = decode(tid)
        raw = t if isinstance(t, bytes) else t.encode("utf-8")
        cache[tid] = (raw.decode("utf-8", errors="replace"), list(raw))
    return cache[tid]


def _lp(x: float) -> float:
    return max(float(x), -9999.0)  # JSON has no -inf


def chat_logprobs(token_ids: List[int], logprobs: Optional[List[float]],
                  top_logprobs: Optional[List[List[Tuple[int, float]]]], decode: Decode) -> ChoiceLogprobs:
    """Chat `logprobs` ({content: [{token, logprob, bytes, top_logprobs}]}) of the tokens."""
    cache: dict = {}

    def top(i):
        return [TopLogprob(token=s, bytes=b, logprob=_lp(l))
                for t, l in top_logprobs[i] for s, b in [_tok(decode, cache, t)]]

    return ChoiceLogprobs(content=[
        TokenLogprob(token=s, bytes=b, logprob=_lp(lp), top_logprobs=top(i) if top_logprobs else [])
        for i, (t, lp) in enumerate(zip(token_ids, logprobs or [])) for s, b in [_tok(decode, cache, t)]])


def completion_logprobs(token_ids: List[int], logprobs: Optional[List[float]],
                        top_logprobs: Optional[List[List[Tuple[int, float]]]], decode: Decode,
                        text_offset: int = 0) -> CompletionLogprobs:
    """Legacy `logprobs` (tokens, token_logprobs, top_logprobs, text_offset); `text_offset`
    is where these tokens' text starts (the length of the text before them)."""
    cache: dict = {}
    tokens = [_tok(decode, cache, t)[0] for t in token_ids[: len(logprobs or [])]]
    offsets = []
    for s in tokens:
        offsets.append(text_offset)
        text_offset += len(s)
    tops = [{_tok(decode, cache, t)[0]: _lp(l) for t, l in row} for row in top_logprobs] if top_logprobs else None
    return CompletionLogprobs(tokens=tokens, token_logprobs=[_lp(x) for x in logprobs or []], top_logprobs=tops,
                              text_offset=offsets)


def finish_reason(reason: Optional[str]) -> Optional[FinishReason]:
    """The engine's finish reason in OpenAI's terms: length stays, stop/abort/error -> stop
    (errors are the ingress's to report: check `out.finish_reason == "error"` first)."""
    return None if reason is None else ("length" if reason == "length" else "stop")


def merge_outputs(outputs: Iterable[RequestOutput]) -> List[RequestOutput]:
    """One RequestOutput per sample (sorted by index): streamed pieces concatenated,
    finish fields and token counts from the last piece."""
    by: Dict[int, List[RequestOutput]] = {}
    for o in outputs:
        by.setdefault(o.index, []).append(o)

    def cat(xs):
        return None if all(x is None for x in xs) else [v for x in xs if x for v in x]

    return [replace(parts[-1], token_ids=[t for o in parts for t in o.token_ids], text="".join(o.text for o in parts),
                    logprobs=cat([o.logprobs for o in parts]), top_logprobs=cat([o.top_logprobs for o in parts]))
            for _, parts in sorted(by.items())]


def usage(outputs: Iterable[RequestOutput]) -> Usage:
    """Token usage of a request from its outputs (all, or each sample's last): the prompt
    counts once, completions add up over the n samples."""
    last: Dict[int, RequestOutput] = {}
    for o in outputs:
        last[o.index] = o
    outs = [last[i] for i in sorted(last)]
    prompt = outs[0].num_prompt_tokens if outs else 0
    completion = sum(o.num_output_tokens for o in outs)
    cached = outs[0].num_cached_tokens if outs else 0
    return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                 prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))


def _logprobs(fn, o: RequestOutput, decode: Optional[Decode], *args):
    return fn(o.token_ids, o.logprobs, o.top_logprobs, decode, *args) if o.logprobs is not None and decode else None


ParseCalls = Callable[[RequestOutput], Tuple[str, List[ToolCall]]]  # a whole sample -> content, calls


def chat_completion(outputs: Iterable[RequestOutput], model: str, decode: Optional[Decode] = None,
                    id: Optional[str] = None, created: Optional[int] = None,
                    parse_calls: Optional[ParseCalls] = None) -> ChatCompletion:
    """The non-streamed response from all of a request's outputs (logprobs need `decode`;
    `parse_calls` splits a sample's text into content and tool calls)."""
    outs = merge_outputs(outputs)
    choices = []
    for o in outs:
        content, calls = parse_calls(o) if parse_calls else (o.text, [])
        reason = finish_reason(o.finish_reason) or "stop"
        choices.append(ChatChoice(index=o.index, message=AssistantMessage(content=content or (None if calls else ""),
                                                                          tool_calls=calls or None),
                                  finish_reason="tool_calls" if calls and reason == "stop" else reason,
                                  logprobs=_logprobs(chat_logprobs, o, decode)))
    return ChatCompletion(id=id or random_id("chatcmpl"), created=created or _now(), model=model, choices=choices,
                          usage=usage(outs))


def chat_chunk(out: RequestOutput, id: str, created: int, model: str, decode: Optional[Decode] = None,
               first: bool = False, text: Optional[str] = None, tool_calls: Optional[List[ToolCallDelta]] = None,
               called: bool = False) -> ChatCompletionChunk:
    """One streamed piece of sample `out.index`; `first` adds role "assistant" to the delta.
    With tools, `text` is the piece's content and `tool_calls` its completed calls;
    `called`: the sample has made a call (its finish reason is then "tool_calls")."""
    text = out.text if text is None else text
    delta = Delta(role="assistant" if first else None, content=text if text or first else None,
                  tool_calls=tool_calls or None)
    reason = finish_reason(out.finish_reason) if out.finished else None
    choice = ChatChunkChoice(index=out.index, delta=delta, logprobs=_logprobs(chat_logprobs, out, decode),
                             finish_reason="tool_calls" if called and reason == "stop" else reason)
    return ChatCompletionChunk(id=id, created=created, model=model, choices=[choice])


def completion(outputs: Iterable[RequestOutput], model: str, decode: Optional[Decode] = None,
               id: Optional[str] = None, created: Optional[int] = None) -> Completion:
    """The non-streamed text completion from all of a request's outputs."""
    outs = merge_outputs(outputs)
    choices = [CompletionChoice(index=o.index, text=o.text, logprobs=_logprobs(completion_logprobs, o, decode),
                                finish_reason=finish_reason(o.finish_reason) or "stop") for o in outs]
    return Completion(id=id or random_id("cmpl"), created=created or _now(), model=model, choices=choices,
                      usage=usage(outs))


def completion_chunk(out: RequestOutput, id: str, created: int, model: str, decode: Optional[Decode] = None,
                     text_offset: int = 0) -> CompletionChunk:
    """One streamed piece of sample `out.index`; `text_offset`: that sample's text length so far."""
    lp = _logprobs(completion_logprobs, out, decode, text_offset)
    choice = CompletionChoice(index=out.index, text=out.text, logprobs=lp,
                              finish_reason=finish_reason(out.finish_reason) if out.finished else None)
    return Completion(id=id, created=created, model=model, choices=[choice])

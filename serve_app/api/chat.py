"""POST /v1/chat/completions: the request (messages, tools) and the response and
stream chunks built from the engine's outputs."""

from typing import Any, Callable, Dict, Iterable, List, Literal, Optional, Tuple

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_serializer, model_validator

from mlx_worker.request import RequestOutput

from .openai_common import (
    Decode,
    FinishReason,
    Usage,
    _json_or_text,
    _logprobs,
    _lp,
    _now,
    _Request,
    _tok,
    finish_reason,
    merge_outputs,
    random_id,
    usage,
)
from .output_parser import Parsed
from .tools import Tool, ToolCall, ToolChoice


class Message(BaseModel):
    """A chat message; content is text (a list of text parts is joined with newlines). A
    user message's image_url parts keep their places among its text parts (`parts`)."""

    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: Optional[str] = None
    name: Optional[str] = None
    tool_calls: Optional[List[ToolCall]] = None  # an assistant's earlier calls
    tool_call_id: Optional[str] = None  # a tool message: the call it answers
    parts: Optional[List[Dict[str, Any]]] = None  # text and {"type": "image"} parts in order, when it shows images
    image_urls: List[str] = Field(default_factory=list)  # its images' URLs (data URIs, http(s)), in order

    @model_validator(mode="before")
    @classmethod
    def _image_parts(cls, data):
        content = data.get("content") if isinstance(data, dict) else None
        if not isinstance(content, list) or not any(_is_image(p) for p in content):
            return data
        if data.get("role") != "user":
            raise ValueError("only user messages may hold images")
        parts, urls = [], []
        for p in content:
            if _is_image(p):
                image = p.get("image_url")
                url = image.get("url") if isinstance(image, dict) else image
                if not isinstance(url, str) or not url:
                    raise ValueError('an image_url part needs {"url": "data:image/...;base64,..." or "https://..."}')
                urls.append(url)
                parts.append({"type": "image"})
            elif isinstance(p, dict) and isinstance(p.get("text"), str):
                parts.append({"type": "text", "text": p["text"]})
        return {**data, "content": [p for p in content if not _is_image(p)], "parts": parts, "image_urls": urls}

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
        m: Dict[str, Any] = {"role": "system" if self.role == "developer" else self.role,
                             "content": self.parts or self.content or ""}
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
    chat_template_kwargs: Optional[Dict[str, Any]] = None  # e.g. {"enable_thinking": false}
    reasoning_effort: Optional[Literal["minimal", "low", "medium", "high"]] = None  # for templates that take it

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

    def image_urls(self) -> List[str]:
        """The images of all messages, in the order the prompt shows them."""
        return [u for m in self.messages for u in m.image_urls]


def _is_image(part) -> bool:
    return isinstance(part, dict) and part.get("type") == "image_url"


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: Optional[List[int]] = None


class TokenLogprob(TopLogprob):
    top_logprobs: List[TopLogprob] = Field(default_factory=list)


class ChoiceLogprobs(BaseModel):
    content: Optional[List[TokenLogprob]] = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: Optional[str] = None
    reasoning_content: Optional[str] = None  # a reasoning model's thinking (vLLM's field)
    tool_calls: Optional[List[ToolCall]] = None

    @model_serializer(mode="wrap")
    def _drop_absent(self, handler):
        d = handler(self)
        for key in ("tool_calls", "reasoning_content"):
            if d.get(key) is None:
                d.pop(key, None)
        return d


class FunctionDelta(BaseModel):
    name: Optional[str] = None
    arguments: str = ""


class ToolCallDelta(BaseModel):
    """A streamed piece of a call: `id`, `type` and the name once, then arguments."""

    index: int
    id: Optional[str] = None
    type: Optional[Literal["function"]] = None
    function: FunctionDelta

    @model_serializer(mode="wrap")
    def _drop_none(self, handler):
        d = handler(self)
        d["function"] = {k: v for k, v in d["function"].items() if v is not None}
        return {k: v for k, v in d.items() if v is not None}


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
    reasoning_content: Optional[str] = None
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


Parse = Callable[[RequestOutput], Parsed]  # a whole sample -> content, reasoning, tool calls


def chat_completion(outputs: Iterable[RequestOutput], model: str, decode: Optional[Decode] = None,
                    id: Optional[str] = None, created: Optional[int] = None,
                    parse: Optional[Parse] = None) -> ChatCompletion:
    """The non-streamed response from all of a request's outputs (logprobs need `decode`;
    `parse` splits a sample's text into reasoning, content and tool calls)."""
    outs = merge_outputs(outputs)
    choices = []
    for o in outs:
        p = parse(o) if parse else Parsed(o.text)
        reason = finish_reason(o.finish_reason) or "stop"
        message = AssistantMessage(content=p.content or (None if p.calls else ""), reasoning_content=p.reasoning or None,
                                   tool_calls=list(p.calls) or None)
        choices.append(ChatChoice(index=o.index, message=message, logprobs=_logprobs(chat_logprobs, o, decode),
                                  finish_reason="tool_calls" if p.calls and reason == "stop" else reason))
    return ChatCompletion(id=id or random_id("chatcmpl"), created=created or _now(), model=model, choices=choices,
                          usage=usage(outs))


def chat_chunk(out: RequestOutput, id: str, created: int, model: str, decode: Optional[Decode] = None,
               first: bool = False, parsed: Optional[Parsed] = None, called: bool = False) -> ChatCompletionChunk:
    """One streamed piece of sample `out.index`; `first` adds role "assistant" to the delta.
    `parsed` splits the piece into content, reasoning and pieces of calls; `called`: the
    sample has made a call (its finish reason is then "tool_calls")."""
    p = parsed if parsed is not None else Parsed(out.text)
    calls = [ToolCallDelta(index=c.index, id=c.id, type="function" if c.name else None,
                           function=FunctionDelta(name=c.name, arguments=c.arguments))
             for c in p.pieces if c.name or c.arguments]
    delta = Delta(role="assistant" if first else None, content=p.content if p.content or first else None,
                  reasoning_content=p.reasoning or None, tool_calls=calls or None)
    reason = finish_reason(out.finish_reason) if out.finished else None
    choice = ChatChunkChoice(index=out.index, delta=delta, logprobs=_logprobs(chat_logprobs, out, decode),
                             finish_reason="tool_calls" if called and reason == "stop" else reason)
    return ChatCompletionChunk(id=id, created=created, model=model, choices=[choice])

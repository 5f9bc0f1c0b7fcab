"""POST /v1/messages (and /v1/messages/count_tokens): Anthropic's Messages API.

A request is mapped onto a chat completion request (system, text / tool_use /
tool_result blocks -> chat messages with tool calls; tools and tool_choice -> OpenAI's),
so it takes the chat path to the engine; the outputs come back as a `Message` or as
Anthropic's stream events, built with the `anthropic` package's own types.
"""

import json
from typing import Any, Dict, Iterator, List, Literal, Optional, Sequence, Union

from anthropic.types import (
    Message,
    MessageDeltaUsage,
    RawContentBlockDeltaEvent,
    RawContentBlockStartEvent,
    RawContentBlockStopEvent,
    RawMessageDeltaEvent,
    RawMessageStartEvent,
    RawMessageStopEvent,
    TextBlock,
    ThinkingBlock,
    ToolUseBlock,
    Usage,
)
from anthropic.types.raw_message_delta_event import Delta as MessageDelta
from pydantic import BaseModel, ConfigDict, Field, model_validator

from mlx_worker.request import RequestOutput

from .chat import ChatCompletionRequest
from .openai_common import merge_outputs
from .output_parser import CallPiece, Parsed
from .tools import ToolCall


def error_body(status: int, message: str) -> dict:
    """Anthropic's error shape: {"type": "error", "error": {"type", "message"}}."""
    kinds = {401: "authentication_error", 403: "permission_error", 404: "not_found_error",
             413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}
    kind = kinds.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


# --- request ------------------------------------------------------------------------------
class Block(BaseModel):
    """A content block: text, image, tool_use (an assistant's call) or tool_result."""

    model_config = ConfigDict(extra="ignore")
    type: Literal["text", "image", "tool_use", "tool_result", "thinking", "redacted_thinking"]
    text: Optional[str] = None
    source: Optional[Dict[str, Any]] = None  # image: {"type": "base64", "media_type", "data"} | {"type": "url", "url"}
    id: Optional[str] = None  # tool_use
    name: Optional[str] = None
    input: Optional[Dict[str, Any]] = None
    tool_use_id: Optional[str] = None  # tool_result
    content: Optional[Union[str, List[Dict[str, Any]]]] = None
    is_error: Optional[bool] = None

    def result_text(self) -> str:
        if isinstance(self.content, list):
            return "\n".join(b.get("text", "") for b in self.content if b.get("type") == "text")
        return self.content or ""


class InputMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["user", "assistant"]
    content: Union[str, List[Block]]


class AnthropicTool(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str
    description: Optional[str] = None
    input_schema: Dict[str, Any]


class AnthropicToolChoice(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["auto", "any", "tool", "none"]
    name: Optional[str] = None
    disable_parallel_tool_use: Optional[bool] = None


class MessagesRequest(BaseModel):
    """POST /v1/messages."""

    model_config = ConfigDict(extra="ignore")
    model: Optional[str] = None
    messages: List[InputMessage] = Field(min_length=1)
    system: Optional[Union[str, List[Block]]] = None
    max_tokens: int = Field(ge=1)
    stop_sequences: Optional[List[str]] = None
    temperature: Optional[float] = Field(None, ge=0, le=1)
    top_p: Optional[float] = None
    top_k: Optional[int] = None
    stream: Optional[bool] = False
    tools: Optional[List[AnthropicTool]] = None
    tool_choice: Optional[AnthropicToolChoice] = None
    metadata: Optional[Dict[str, Any]] = None  # ignored

    @model_validator(mode="after")
    def _choice_names_a_tool(self):
        if self.tool_choice and self.tool_choice.type == "tool" and not self.tool_choice.name:
            raise ValueError('tool_choice of type "tool" needs a "name"')
        return self

    def to_chat(self, max_tokens: Optional[int] = None) -> ChatCompletionRequest:
        """The same request as a chat completion (validated as one: unknown tool names in
        tool_choice, tool results that answer no call, ... fail there)."""
        messages: List[Dict[str, Any]] = []
        if self.system:
            system = self.system if isinstance(self.system, str) else "\n".join(b.text or "" for b in self.system)
            messages.append({"role": "system", "content": system})
        for m in self.messages:
            messages += _chat_messages(m)
        choice: Any = None
        if self.tool_choice:
            c = self.tool_choice
            choice = {"auto": "auto", "any": "required", "none": "none"}.get(c.type) or \
                {"type": "function", "function": {"name": c.name}}
        tools = [{"type": "function", "function": {"name": t.name, "description": t.description,
                                                   "parameters": t.input_schema}} for t in self.tools or []]
        return ChatCompletionRequest.model_validate({
            "model": self.model, "messages": messages, "max_tokens": max_tokens or self.max_tokens,
            "stop": self.stop_sequences, "temperature": 1.0 if self.temperature is None else self.temperature,
            "top_p": self.top_p if self.top_p is not None else 1.0, "top_k": self.top_k,
            "tools": tools or None, "tool_choice": choice if tools else None,
        })


class CountTokensRequest(MessagesRequest):
    """POST /v1/messages/count_tokens: a Messages request without max_tokens."""

    max_tokens: int = 1


def _chat_messages(m: InputMessage) -> List[Dict[str, Any]]:
    """One Anthropic message as chat messages: tool results become tool messages."""
    if isinstance(m.content, str):
        return [{"role": m.role, "content": m.content}]
    out: List[Dict[str, Any]] = []
    text = [b.text or "" for b in m.content if b.type == "text"]
    if m.role == "assistant":
        calls = [{"id": b.id, "type": "function", "function": {"name": b.name, "arguments": json.dumps(b.input or {})}}
                 for b in m.content if b.type == "tool_use"]
        msg: Dict[str, Any] = {"role": "assistant", "content": "\n".join(text) or None}
        if calls:
            msg["tool_calls"] = calls
        return [msg]
    for b in m.content:
        if b.type == "tool_result":
            out.append({"role": "tool", "tool_call_id": b.tool_use_id,
                        "content": ("Error: " if b.is_error else "") + b.result_text()})
    if any(b.type == "image" for b in m.content):  # text and images in their order, as chat parts
        parts = [{"type": "text", "text": b.text or ""} if b.type == "text" else
                 {"type": "image_url", "image_url": {"url": _image_url(b.source or {})}}
                 for b in m.content if b.type in ("text", "image")]
        out.append({"role": "user", "content": parts})
    elif text:
        out.append({"role": "user", "content": "\n".join(text)})
    return out


def _image_url(source: Dict[str, Any]) -> str:
    if source.get("type") == "base64":
        return f"data:{source.get('media_type', 'image/png')};base64,{source.get('data', '')}"
    if source.get("type") == "url" and isinstance(source.get("url"), str):
        return source["url"]
    raise ValueError('an image block\'s source must be {"type": "base64", "media_type", "data"} or '
                     '{"type": "url", "url"}')


# --- response -----------------------------------------------------------------------------
def stop_reason(out: RequestOutput, called: bool) -> str:
    if called:
        return "tool_use"
    if out.finish_reason == "length":
        return "max_tokens"
    return "stop_sequence" if isinstance(out.stop_reason, str) else "end_turn"


def usage(out: RequestOutput) -> Usage:
    return Usage(input_tokens=out.num_prompt_tokens - out.num_cached_tokens, output_tokens=out.num_output_tokens,
                 cache_read_input_tokens=out.num_cached_tokens, cache_creation_input_tokens=0)


def _tool_use(call: ToolCall) -> ToolUseBlock:
    try:
        args = json.loads(call.function.arguments)
    except ValueError:
        args = {}
    return ToolUseBlock(type="tool_use", id=call.id, name=call.function.name, input=args)


def message(outputs: List[RequestOutput], model: str, id: str, parse=None) -> Message:
    """The non-streamed response from all of a request's outputs; `parse` splits the
    text into thinking, text and tool calls."""
    out = merge_outputs(outputs)[0]
    p = parse(out) if parse else Parsed(out.text)
    content = [ThinkingBlock(type="thinking", thinking=p.reasoning, signature="")] if p.reasoning else []
    content += [TextBlock(type="text", text=p.content)] if p.content or not p.calls else []
    content += [_tool_use(c) for c in p.calls]
    return Message(id=id, type="message", role="assistant", model=model, content=content,
                   stop_reason=stop_reason(out, bool(p.calls)),
                   stop_sequence=out.stop_reason if isinstance(out.stop_reason, str) else None, usage=usage(out))


class StreamWriter:
    """Anthropic's event sequence for one streamed message: message_start, then for each
    content block start / deltas / stop, then message_delta (stop reason, usage) and
    message_stop. Reasoning goes in thinking blocks, text in text blocks, each tool call
    in a tool_use block whose input arrives as input_json_delta."""

    def __init__(self, model: str, id: str):
        self.model, self.id = model, id
        self.index = -1
        self.open: Optional[str] = None  # the open block's type
        self.called = False

    def start(self, first: RequestOutput) -> Iterator[BaseModel]:
        msg = Message(id=self.id, type="message", role="assistant", model=self.model, content=[], stop_reason=None,
                      stop_sequence=None, usage=Usage(input_tokens=first.num_prompt_tokens - first.num_cached_tokens,
                                                      output_tokens=0,
                                                      cache_read_input_tokens=first.num_cached_tokens,
                                                      cache_creation_input_tokens=0))
        yield RawMessageStartEvent(type="message_start", message=msg)

    def events(self, piece: Parsed) -> List[BaseModel]:
        """The events of one parsed piece of the sample."""
        return [*self.thinking(piece.reasoning), *self.text(piece.content), *self.tool_calls(piece.pieces)]

    def thinking(self, text: str) -> Iterator[BaseModel]:
        if not text:
            return
        if self.open != "thinking":
            yield from self._close()
            yield from self._open(ThinkingBlock(type="thinking", thinking="", signature=""), "thinking")
        yield RawContentBlockDeltaEvent(type="content_block_delta", index=self.index,
                                        delta={"type": "thinking_delta", "thinking": text})

    def text(self, text: str) -> Iterator[BaseModel]:
        if not text:
            return
        if self.open != "text":
            yield from self._close()
            yield from self._open(TextBlock(type="text", text=""), "text")
        yield RawContentBlockDeltaEvent(type="content_block_delta", index=self.index,
                                        delta={"type": "text_delta", "text": text})

    def tool_calls(self, pieces: Sequence[CallPiece]) -> Iterator[BaseModel]:
        """Pieces of calls: a named piece opens a tool_use block, arguments arrive as
        input_json_delta."""
        for piece in pieces:
            if piece.name is not None:
                yield from self._close()
                yield from self._open(ToolUseBlock(type="tool_use", id=piece.id, name=piece.name, input={}), "tool")
                self.called = True
            if piece.arguments:
                yield RawContentBlockDeltaEvent(type="content_block_delta", index=self.index,
                                                delta={"type": "input_json_delta", "partial_json": piece.arguments})

    def finish(self, last: RequestOutput) -> Iterator[BaseModel]:
        if self.index < 0:  # no content at all: still one (empty) text block
            yield from self._open(TextBlock(type="text", text=""), "text")
        yield from self._close()
        yield RawMessageDeltaEvent(type="message_delta", delta=MessageDelta(
            stop_reason=stop_reason(last, self.called),
            stop_sequence=last.stop_reason if isinstance(last.stop_reason, str) else None),
            usage=MessageDeltaUsage(output_tokens=last.num_output_tokens))
        yield RawMessageStopEvent(type="message_stop")

    def _open(self, block, kind: str) -> Iterator[BaseModel]:
        self.index += 1
        self.open = kind
        yield RawContentBlockStartEvent(type="content_block_start", index=self.index, content_block=block)

    def _close(self) -> Iterator[BaseModel]:
        if self.open is not None:
            self.open = None
            yield RawContentBlockStopEvent(type="content_block_stop", index=self.index)


def error_event(status: int, message: str) -> str:
    return f"event: error\ndata: {json.dumps(error_body(status, message))}\n\n"


def sse(event: BaseModel) -> str:
    return f"event: {event.type}\ndata: {event.model_dump_json(exclude_unset=True)}\n\n"

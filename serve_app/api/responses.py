"""POST /v1/responses: OpenAI's Responses API.

A request is mapped onto a chat completion request (instructions, input messages,
function_call / function_call_output items -> chat messages with tool calls; function
tools, tool_choice, text.format -> OpenAI chat's), so it takes the chat path to the
engine; the outputs come back as a `Response` or as its stream events, built with the
`openai` package's own types. Nothing is stored: `previous_response_id` and `store: true`
are refused.
"""

import json
import time
from typing import Any, Dict, Iterator, List, Literal, Optional, Sequence, Union

from openai.types.responses import (
    Response,
    ResponseCompletedEvent,
    ResponseContentPartAddedEvent,
    ResponseContentPartDoneEvent,
    ResponseCreatedEvent,
    ResponseFunctionCallArgumentsDeltaEvent,
    ResponseFunctionCallArgumentsDoneEvent,
    ResponseFunctionToolCall,
    ResponseIncompleteEvent,
    ResponseInProgressEvent,
    ResponseOutputItemAddedEvent,
    ResponseOutputItemDoneEvent,
    ResponseOutputMessage,
    ResponseOutputText,
    ResponseReasoningItem,
    ResponseReasoningTextDeltaEvent,
    ResponseTextDeltaEvent,
    ResponseTextDoneEvent,
    ResponseUsage,
)
from openai.types.responses.response_reasoning_item import Content as ReasoningText
from openai.types.responses.response_usage import InputTokensDetails, OutputTokensDetails
from pydantic import BaseModel, ConfigDict, Field, model_validator

from mlx_worker.request import RequestOutput

from .chat import ChatCompletionRequest
from .openai_common import merge_outputs, random_id
from .output_parser import CallPiece, Parsed
from .tools import ToolCall


# --- request ------------------------------------------------------------------------------
class FunctionTool(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["function"]
    name: str
    description: Optional[str] = None
    parameters: Optional[Dict[str, Any]] = None
    strict: Optional[bool] = None


class TextFormat(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)
    type: Literal["text", "json_object", "json_schema"]
    name: Optional[str] = None
    schema_: Optional[Dict[str, Any]] = Field(None, alias="schema")
    strict: Optional[bool] = None


class TextConfig(BaseModel):
    model_config = ConfigDict(extra="ignore")
    format: Optional[TextFormat] = None


class Reasoning(BaseModel):
    model_config = ConfigDict(extra="ignore")
    effort: Optional[Literal["minimal", "low", "medium", "high"]] = None


class ResponsesRequest(BaseModel):
    """POST /v1/responses."""

    model_config = ConfigDict(extra="ignore")
    model: Optional[str] = None
    input: Union[str, List[Dict[str, Any]]]
    instructions: Optional[str] = None
    tools: Optional[List[FunctionTool]] = None
    tool_choice: Optional[Union[Literal["auto", "none", "required"], Dict[str, Any]]] = None
    parallel_tool_calls: Optional[bool] = None
    max_output_tokens: Optional[int] = Field(None, ge=1)
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    text: Optional[TextConfig] = None
    reasoning: Optional[Reasoning] = None
    stream: Optional[bool] = False
    store: Optional[bool] = None
    previous_response_id: Optional[str] = None
    metadata: Optional[Dict[str, str]] = None

    @model_validator(mode="before")
    @classmethod
    def _only_function_tools(cls, data):
        for t in (data.get("tools") or []) if isinstance(data, dict) else []:
            if isinstance(t, dict) and t.get("type") != "function":
                raise ValueError(f"tools: only function tools are served, not {t.get('type')!r}")
        return data

    @model_validator(mode="after")
    def _nothing_stored(self):
        if self.previous_response_id:
            raise ValueError("previous_response_id: responses are not stored; send the whole conversation in input")
        if self.store:
            raise ValueError("store: responses are not stored; send store: false (or leave it out)")
        return self

    def to_chat(self) -> ChatCompletionRequest:
        messages: List[Dict[str, Any]] = [{"role": "system", "content": self.instructions}] if self.instructions else []
        items = [{"role": "user", "content": self.input}] if isinstance(self.input, str) else self.input
        for item in items:
            _add_item(messages, item)
        choice = self.tool_choice
        if isinstance(choice, dict):
            choice = {"type": "function", "function": {"name": choice.get("name")}}
        fmt = self.text.format if self.text else None
        response_format = None
        if fmt and fmt.type == "json_schema":
            response_format = {"type": "json_schema", "json_schema": {"name": fmt.name, "schema": fmt.schema_}}
        elif fmt and fmt.type == "json_object":
            response_format = {"type": "json_object"}
        tools = [{"type": "function", "function": {"name": t.name, "description": t.description,
                                                   "parameters": t.parameters or {"type": "object", "properties": {}}}}
                 for t in self.tools or []]
        return ChatCompletionRequest.model_validate({
            "model": self.model, "messages": messages, "max_tokens": self.max_output_tokens,
            "temperature": 1.0 if self.temperature is None else self.temperature,
            "top_p": 1.0 if self.top_p is None else self.top_p, "tools": tools or None,
            "tool_choice": choice if tools else None, "response_format": response_format,
            "reasoning_effort": self.reasoning.effort if self.reasoning else None,
        })


def _add_item(messages: List[Dict[str, Any]], item: Dict[str, Any]) -> None:
    """One input item as chat messages: a function call joins the assistant message
    before it (or opens one), its output becomes a tool message; reasoning is dropped."""
    kind = item.get("type", "message")
    if kind == "message":
        content = item.get("content")
        if isinstance(content, list) and any(p.get("type") == "input_image" for p in content):
            # text and images in their order, as chat parts (input_image: {"image_url": "data:..." | "https://..."})
            content = [{"type": "image_url", "image_url": {"url": p.get("image_url") or ""}}
                       if p.get("type") == "input_image" else {"type": "text", "text": p.get("text", "")}
                       for p in content if p.get("type") in ("input_text", "output_text", "text", "input_image")]
        elif isinstance(content, list):
            content = "\n".join(p.get("text", "") for p in content
                                if p.get("type") in ("input_text", "output_text", "text"))
        messages.append({"role": item.get("role"), "content": content})
    elif kind == "function_call":
        call = {"id": item.get("call_id"), "type": "function",
                "function": {"name": item.get("name"), "arguments": item.get("arguments", "{}")}}
        if messages and messages[-1]["role"] == "assistant":
            messages[-1].setdefault("tool_calls", []).append(call)
        else:
            messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
    elif kind == "function_call_output":
        output = item.get("output")
        messages.append({"role": "tool", "tool_call_id": item.get("call_id"),
                         "content": output if isinstance(output, str) else json.dumps(output)})
    elif kind != "reasoning":
        raise ValueError(f"input items of type {kind!r} are not supported")


# --- response -----------------------------------------------------------------------------
def new_id(prefix: str) -> str:
    return random_id(prefix, "_")  # OpenAI's response and item ids take "_"


def _usage(out: RequestOutput) -> ResponseUsage:
    return ResponseUsage(input_tokens=out.num_prompt_tokens,
                         input_tokens_details=InputTokensDetails(cached_tokens=out.num_cached_tokens, cache_write_tokens=0),
                         output_tokens=out.num_output_tokens,
                         output_tokens_details=OutputTokensDetails(reasoning_tokens=0),
                         total_tokens=out.num_prompt_tokens + out.num_output_tokens)


def _call(call: ToolCall, status: str = "completed") -> ResponseFunctionToolCall:
    return ResponseFunctionToolCall(type="function_call", id=new_id("fc"), call_id=call.id, name=call.function.name,
                                    arguments=call.function.arguments, status=status)


class Builder:
    """The Response object of one request, with its output items in order."""

    def __init__(self, body: ResponsesRequest, model: str, id: str):
        self.body, self.model, self.id = body, model, id
        self.created = time.time()
        self.output: List[BaseModel] = []

    def response(self, last: Optional[RequestOutput] = None) -> Response:
        status = "in_progress" if last is None else ("incomplete" if last.finish_reason == "length" else "completed")
        return Response(
            id=self.id, object="response", created_at=self.created, model=self.model, status=status,
            output=list(self.output), parallel_tool_calls=self.body.parallel_tool_calls is not False,
            tool_choice=self.body.tool_choice if isinstance(self.body.tool_choice, str) else "auto",
            tools=[t.model_dump(exclude_none=True) for t in self.body.tools or []],
            instructions=self.body.instructions, temperature=self.body.temperature, top_p=self.body.top_p,
            max_output_tokens=self.body.max_output_tokens, metadata=self.body.metadata,
            incomplete_details={"reason": "max_output_tokens"} if status == "incomplete" else None,
            usage=_usage(last) if last is not None else None)


def response(body: ResponsesRequest, outputs: List[RequestOutput], model: str, id: str, parse=None) -> Response:
    """The non-streamed response; `parse` splits the text into reasoning, text and calls."""
    out = merge_outputs(outputs)[0]
    p = parse(out) if parse else Parsed(out.text)
    b = Builder(body, model, id)
    if p.reasoning:
        b.output.append(ResponseReasoningItem(type="reasoning", id=new_id("rs"), summary=[], status="completed",
                                              content=[ReasoningText(type="reasoning_text", text=p.reasoning)]))
    if p.content or not p.calls:
        b.output.append(ResponseOutputMessage(type="message", id=new_id("msg"), role="assistant", status="completed",
                                              content=[ResponseOutputText(type="output_text", text=p.content,
                                                                          annotations=[])]))
    b.output += [_call(c) for c in p.calls]
    return b.response(out)


class StreamWriter:
    """The Responses event sequence: response.created / in_progress; per output item
    output_item.added, its deltas (reasoning_text, content_part + output_text, or
    function_call_arguments) and output_item.done; then response.completed (or
    response.incomplete at the token limit) carrying the whole response."""

    def __init__(self, body: ResponsesRequest, model: str, id: str):
        self.builder = Builder(body, model, id)
        self.seq = 0
        self.open: Optional[str] = None  # "reasoning" | "message"
        self.item_id = ""
        self.text = ""

    def _ev(self, cls, **kw) -> BaseModel:
        self.seq += 1
        return cls(sequence_number=self.seq - 1, **kw)

    @property
    def index(self) -> int:
        return len(self.builder.output)

    def events(self, piece: Parsed) -> List[BaseModel]:
        """The events of one parsed piece of the sample."""
        return [*self.reasoning(piece.reasoning), *self.message(piece.content), *self.calls(piece.pieces)]

    def start(self, first: Optional[RequestOutput] = None) -> Iterator[BaseModel]:
        r = self.builder.response()
        yield self._ev(ResponseCreatedEvent, type="response.created", response=r)
        yield self._ev(ResponseInProgressEvent, type="response.in_progress", response=r)

    def reasoning(self, text: str) -> Iterator[BaseModel]:
        if not text:
            return
        if self.open != "reasoning":
            yield from self._close()
            self.open, self.item_id, self.text = "reasoning", new_id("rs"), ""
            item = ResponseReasoningItem(type="reasoning", id=self.item_id, summary=[], status="in_progress")
            yield self._ev(ResponseOutputItemAddedEvent, type="response.output_item.added", output_index=self.index,
                           item=item)
        self.text += text
        yield self._ev(ResponseReasoningTextDeltaEvent, type="response.reasoning_text.delta", item_id=self.item_id,
                       output_index=self.index, content_index=0, delta=text)

    def message(self, text: str) -> Iterator[BaseModel]:
        if not text:
            return
        if self.open != "message":
            yield from self._open_message()
        self.text += text
        yield self._ev(ResponseTextDeltaEvent, type="response.output_text.delta", item_id=self.item_id,
                       output_index=self.index, content_index=0, delta=text, logprobs=[])

    def calls(self, pieces: Sequence[CallPiece]) -> Iterator[BaseModel]:
        """Pieces of calls: a named piece adds a function_call item, arguments arrive as
        function_call_arguments deltas, the last piece closes the item."""
        for piece in pieces:
            if piece.name is not None:
                yield from self._close()
                self.open, self.item_id, self.text = "call", new_id("fc"), ""
                self.call = ResponseFunctionToolCall(type="function_call", id=self.item_id, call_id=piece.id,
                                                     name=piece.name, arguments="", status="in_progress")
                yield self._ev(ResponseOutputItemAddedEvent, type="response.output_item.added",
                               output_index=self.index, item=self.call)
            if piece.arguments:
                self.text += piece.arguments
                yield self._ev(ResponseFunctionCallArgumentsDeltaEvent, type="response.function_call_arguments.delta",
                               item_id=self.item_id, output_index=self.index, delta=piece.arguments)
            if piece.done:
                yield from self._close()

    def finish(self, last: RequestOutput) -> Iterator[BaseModel]:
        if not self.builder.output and self.open is None:  # no output at all: still one (empty) message
            yield from self._open_message()
        yield from self._close()
        r = self.builder.response(last)
        if r.status == "incomplete":
            yield self._ev(ResponseIncompleteEvent, type="response.incomplete", response=r)
        else:
            yield self._ev(ResponseCompletedEvent, type="response.completed", response=r)

    def _open_message(self) -> Iterator[BaseModel]:
        yield from self._close()
        self.open, self.item_id, self.text = "message", new_id("msg"), ""
        item = ResponseOutputMessage(type="message", id=self.item_id, role="assistant", status="in_progress", content=[])
        yield self._ev(ResponseOutputItemAddedEvent, type="response.output_item.added", output_index=self.index,
                       item=item)
        yield self._ev(ResponseContentPartAddedEvent, type="response.content_part.added", item_id=self.item_id,
                       output_index=self.index, content_index=0,
                       part=ResponseOutputText(type="output_text", text="", annotations=[]))

    def _close(self) -> Iterator[BaseModel]:
        if self.open == "message":
            part = ResponseOutputText(type="output_text", text=self.text, annotations=[])
            yield self._ev(ResponseTextDoneEvent, type="response.output_text.done", item_id=self.item_id,
                           output_index=self.index, content_index=0, text=self.text, logprobs=[])
            yield self._ev(ResponseContentPartDoneEvent, type="response.content_part.done", item_id=self.item_id,
                           output_index=self.index, content_index=0, part=part)
            item = ResponseOutputMessage(type="message", id=self.item_id, role="assistant", status="completed",
                                         content=[part])
        elif self.open == "call":
            yield self._ev(ResponseFunctionCallArgumentsDoneEvent, type="response.function_call_arguments.done",
                           item_id=self.item_id, output_index=self.index, arguments=self.text)
            item = self.call.model_copy(update={"arguments": self.text, "status": "completed"})
        elif self.open == "reasoning":
            item = ResponseReasoningItem(type="reasoning", id=self.item_id, summary=[], status="completed",
                                         content=[ReasoningText(type="reasoning_text", text=self.text)])
        else:
            return
        yield self._ev(ResponseOutputItemDoneEvent, type="response.output_item.done", output_index=self.index,
                       item=item)
        self.builder.output.append(item)
        self.open = None


def error_event(status: int, message: str) -> str:
    error = {"type": "error", "code": "engine_error" if status >= 500 else "invalid_request", "message": message}
    return f"event: error\ndata: {json.dumps(error)}\n\n"


def sse(event: BaseModel) -> str:
    return f"event: {event.type}\ndata: {event.model_dump_json(exclude_none=True)}\n\n"

"""Tool calling for /v1/chat/completions: the request's tool types, the model's call
format, prompts for models that know none, the grammar that guarantees a call, and
the parser that turns generated text into content and OpenAI `tool_calls`.

A model whose tokenizer mlx-lm knows a tool-call format for (`has_tool_calling`) gets
the tools through its own chat template and its calls parsed by mlx-lm's parser. Any
other model (the embedded SmolLM2 among them) gets the tools described in its system
prompt and answers in the fallback format, Hermes/Qwen style JSON between tags:

    <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>

which mlx-lm's `json_tools` parser reads. `tool_choice: "required"` or a named
function constrains the output to one such call (llguidance, the tools' JSON schemas);
that needs a JSON-between-tags format, as the fallback and mlx-lm's `json_tools` are.
"""

import json
import logging
import uuid
from typing import Any, Dict, List, Literal, Optional, Tuple, Union

from mlx_lm.generate import TextStateMachine
from mlx_lm.tool_parsers import json_tools
from pydantic import BaseModel, ConfigDict, Field

from mlx_worker.grammar import GrammarSpec

log = logging.getLogger(__name__)


# --- request types ---------------------------------------------------------------------
class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str = Field(pattern=r"^[a-zA-Z0-9_.-]{1,64}$")
    description: Optional[str] = None
    parameters: Dict[str, Any] = Field(default_factory=lambda: {"type": "object", "properties": {}})
    strict: Optional[bool] = None


class Tool(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["function"]
    function: FunctionDef


class FunctionName(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"]
    function: FunctionName


ToolChoice = Union[Literal["auto", "none", "required"], NamedToolChoice]


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


# --- the call format ---------------------------------------------------------------------
class CallFormat:
    """Where calls start and end in generated text, and how to read one."""

    def __init__(self, start: str, end: Optional[str], parser, json_between_tags: bool, native: bool):
        self.start, self.end, self.parser = start, end, parser
        self.json_between_tags = json_between_tags  # a call is `start + JSON + end`: grammar-constrainable
        self.native = native  # the chat template renders the tools itself

    def state_machine(self) -> TextStateMachine:
        return TextStateMachine({"normal": [(self.start, "tool")], "tool": [(self.end, "normal")] if self.end else []})


def call_format(tokenizer) -> CallFormat:
    """The model's own format when mlx-lm knows it, else the fallback."""
    if getattr(tokenizer, "has_tool_calling", False):
        parser = tokenizer.tool_parser
        return CallFormat(tokenizer.tool_call_start, tokenizer.tool_call_end, parser,
                          parser is json_tools.parse_tool_call, native=True)
    return CallFormat(json_tools.tool_call_start, json_tools.tool_call_end, json_tools.parse_tool_call,
                      json_between_tags=True, native=False)


def fallback_system_prompt(tools: List[Tool]) -> str:
    """The tools and the call format, for a model whose template knows neither."""
    specs = "\n".join(json.dumps(t.function.model_dump(exclude_none=True), ensure_ascii=False) for t in tools)
    return (
        "You can call these functions (JSON schemas of their arguments):\n"
        f"{specs}\n"
        "To call one, answer with exactly:\n"
        f'{json_tools.tool_call_start}{{"name": <function name>, "arguments": <arguments object>}}'
        f"{json_tools.tool_call_end}\n"
        "one call per tag; otherwise answer normally."
    )


def with_tools(messages: List[Dict[str, Any]], tools: List[Tool]) -> List[Dict[str, Any]]:
    """`messages` with the fallback tool prompt at the end of the system message."""
    prompt = fallback_system_prompt(tools)
    if messages and messages[0]["role"] == "system":
        return [{**messages[0], "content": f"{messages[0]['content']}\n\n{prompt}"}] + messages[1:]
    return [{"role": "system", "content": prompt}] + messages


def call_grammar(tools: List[Tool], choice: ToolChoice, fmt: CallFormat) -> Optional[GrammarSpec]:
    """The constraint for `required` (any one tool) or a named tool; None otherwise."""
    if choice in ("auto", "none"):
        return None
    if not fmt.json_between_tags:
        raise ValueError("tool_choice 'required' or a named function needs a JSON tool-call format; "
                         "this model's is not one")
    chosen = [t for t in tools if choice == "required" or t.function.name == choice.function.name]
    calls = [{"type": "object", "properties": {"name": {"const": t.function.name}, "arguments": t.function.parameters},
              "required": ["name", "arguments"], "additionalProperties": False} for t in chosen]
    schema = calls[0] if len(calls) == 1 else {"anyOf": calls}
    newline = "\n" if fmt.native else ""  # Hermes/Qwen templates put the JSON on its own line
    return GrammarSpec(json_schema=schema, prefix=fmt.start + newline, suffix=newline + (fmt.end or ""))


# --- output -----------------------------------------------------------------------------
class ToolCallParser:
    """Splits one sample's generated text into content and tool calls as it streams.
    Text that may be the start of a call marker is held back until it is known not to
    be, so markup never reaches the content."""

    def __init__(self, fmt: CallFormat, tools: List[Tool]):
        self.fmt = fmt
        self.tools = [t.model_dump() for t in tools]
        self._sm = fmt.state_machine()
        self._state = self._sm.make_state("normal")
        self._call_text: Optional[str] = None  # inside a call: its text so far
        self.num_calls = 0

    def feed(self, text: str) -> Tuple[str, List[ToolCall]]:
        """Content and completed calls in `text` (more text of this sample)."""
        self._state, segments = TextStateMachine.split(self._state, text)
        return self._collect(segments)

    def finish(self, reason: Optional[str]) -> Tuple[str, List[ToolCall]]:
        """What is left at the end: held-back text when cut at the length limit (at a stop
        it can only be a partial marker, dropped as mlx-lm's server does); a call cut
        short is still read."""
        if reason == "length":
            self._state, rest, state = TextStateMachine.flush(self._state)
        else:
            (self._state, state), rest = TextStateMachine.discard(self._state), ""
        content, calls = self._collect([(state, rest)])
        if self._call_text is not None:
            calls += self._parse(self._call_text)
            self._call_text = None
        return content, calls

    def _collect(self, segments) -> Tuple[str, List[ToolCall]]:
        content, calls = [], []
        for state, text in segments:
            if state == "tool":
                self._call_text = (self._call_text or "") + text
            else:
                if self._call_text is not None:  # a call just ended
                    calls += self._parse(self._call_text)
                    self._call_text = None
                content.append(text)
        return "".join(content), calls

    def _parse(self, text: str) -> List[ToolCall]:
        try:
            parsed = self.fmt.parser(text, self.tools)
        except (ValueError, json.JSONDecodeError, KeyError, TypeError) as e:
            log.warning("unparsable tool call dropped (%s: %s): %r", type(e).__name__, e, text[:200])
            return []
        out = []
        for call in parsed if isinstance(parsed, list) else [parsed]:
            args = call.get("arguments", {})
            out.append(ToolCall(id=call.get("id") or f"call_{uuid.uuid4().hex[:24]}",
                                function=FunctionCall(name=call["name"], arguments=args if isinstance(args, str)
                                                      else json.dumps(args, ensure_ascii=False))))
        self.num_calls += len(out)
        return out

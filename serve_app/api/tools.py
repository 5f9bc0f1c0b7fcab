"""Tool calling for /v1/chat/completions: the request's tool types, the model's call
format, prompts for models that know none, and the grammar that guarantees a call
(output_parser.py turns generated text into content and OpenAI `tool_calls`).

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
from typing import Any, Dict, List, Literal, Optional, Union

from mlx_lm.tool_parsers import json_tools
from pydantic import BaseModel, ConfigDict, Field

from mlx_worker.sampling.grammar import GrammarSpec


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


def _closed(schema: Dict[str, Any]) -> Dict[str, Any]:
    """A forced call's arguments hold the declared parameters only, as OpenAI's strict
    function calling has it: an object schema that does not say otherwise gets
    additionalProperties false (else a small model may add keys until max_tokens)."""
    if schema.get("type") == "object" and "properties" in schema and "additionalProperties" not in schema:
        return {**schema, "additionalProperties": False}
    return schema


# --- the call format ---------------------------------------------------------------------
class CallFormat:
    """Where calls start and end in generated text, and how to read one."""

    def __init__(self, start: str, end: Optional[str], parser, json_between_tags: bool, native: bool):
        self.start, self.end, self.parser = start, end, parser
        self.json_between_tags = json_between_tags  # a call is `start + JSON + end`: grammar-constrainable
        self.native = native  # the chat template renders the tools itself


def call_format(tokenizer) -> CallFormat:
    """The model's own format when mlx-lm knows it, else the fallback."""
    if getattr(tokenizer, "has_tool_calling", False):
        parser = tokenizer.tool_parser
        return CallFormat(tokenizer.tool_call_start, tokenizer.tool_call_end, parser,
                          parser is json_tools.parse_tool_call, native=True)
    return CallFormat(json_tools.tool_call_start, json_tools.tool_call_end, json_tools.parse_tool_call,
                      json_between_tags=True, native=False)


# gpt-oss (harmony): its template renders the tools; harmony.py reads the calls.
HARMONY_CALLS = CallFormat("<|channel|>commentary to=functions.", None, None, json_between_tags=False, native=True)


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
    calls = [{"type": "object", "properties": {"name": {"const": t.function.name}, "arguments": _closed(t.function.parameters)},
              "required": ["name", "arguments"], "additionalProperties": False} for t in chosen]
    schema = calls[0] if len(calls) == 1 else {"anyOf": calls}
    newline = "\n" if fmt.native else ""  # Hermes/Qwen templates put the JSON on its own line
    return GrammarSpec(json_schema=schema, prefix=fmt.start + newline, suffix=newline + (fmt.end or ""))

"""Splits a sample's generated text into reasoning, content and tool calls as it streams.

The markers are the model's own, as mlx-lm's `TokenizerWrapper` detects them: thinking
(`think_start` ... `think_end`, e.g. <think>...</think>) and tool calls (tools.CallFormat).
mlx-lm's `TextStateMachine` does the splitting: text that may be the start of a marker
is held back until it is known not to be, so markup never reaches the content.
"""

import json
import logging
import uuid
from typing import List, NamedTuple, Optional, Sequence, Tuple

from mlx_lm.generate import TextStateMachine

from .tools import CallFormat, FunctionCall, Tool, ToolCall

log = logging.getLogger(__name__)


class Parsed(NamedTuple):
    content: str = ""
    reasoning: str = ""
    calls: Tuple[ToolCall, ...] = ()

    def __add__(self, other: "Parsed") -> "Parsed":
        return Parsed(self.content + other.content, self.reasoning + other.reasoning, self.calls + other.calls)


class ThinkFormat(NamedTuple):
    start: str
    end: str


def think_format(tokenizer) -> Optional[ThinkFormat]:
    if getattr(tokenizer, "has_thinking", False):
        return ThinkFormat(tokenizer.think_start, tokenizer.think_end)
    return None


def starts_in_reasoning(tokenizer, prompt_ids: Sequence[int]) -> bool:
    """The prompt opened a thinking block it did not close (e.g. a template that ends
    the generation prompt with <think>): the output starts as reasoning."""
    if not getattr(tokenizer, "has_thinking", False):
        return False
    return tokenizer.rfind_think_start(list(prompt_ids)) > tokenizer.rfind_think_end(list(prompt_ids))


class OutputParser:
    """One sample's text -> reasoning, content and calls (`tools` None: no calls)."""

    def __init__(self, think: Optional[ThinkFormat], calls: Optional[CallFormat] = None,
                 tools: Optional[List[Tool]] = None, in_reasoning: bool = False):
        transitions = {}
        if think:
            transitions["normal"] = [(think.start, "reasoning")]
            transitions["reasoning"] = [(think.end, "normal")]
        if tools:
            transitions.setdefault("normal", []).append((calls.start, "tool"))
            if think:
                transitions["reasoning"].append((calls.start, "tool"))
            transitions["tool"] = [(calls.end, "normal")] if calls.end else []
        self.fmt = calls
        self.tools = [t.model_dump() for t in tools or []]
        self._state = TextStateMachine(transitions or None).make_state("reasoning" if in_reasoning and think
                                                                       else "normal")
        self._call_text: Optional[str] = None  # inside a call: its text so far
        self.num_calls = 0

    def feed(self, text: str) -> Parsed:
        """What `text` (more text of this sample) adds."""
        self._state, segments = TextStateMachine.split(self._state, text)
        return self._collect(segments)

    def finish(self, reason: Optional[str]) -> Parsed:
        """What is left at the end: held-back text when cut at the length limit (at a stop
        it can only be a partial marker, dropped as mlx-lm's server does); a call cut
        short is still read."""
        if reason == "length":
            self._state, rest, state = TextStateMachine.flush(self._state)
        else:
            (self._state, state), rest = TextStateMachine.discard(self._state), ""
        parsed = self._collect([(state, rest)])
        if self._call_text is not None:
            parsed += Parsed(calls=tuple(self._parse(self._call_text)))
            self._call_text = None
        return parsed

    def whole(self, text: str, reason: Optional[str]) -> Parsed:
        return self.feed(text) + self.finish(reason)

    def _collect(self, segments) -> Parsed:
        content, reasoning, calls = [], [], []
        for state, text in segments:
            if state == "tool":
                self._call_text = (self._call_text or "") + text
                continue
            if self._call_text is not None:  # a call just ended
                calls += self._parse(self._call_text)
                self._call_text = None
            (reasoning if state == "reasoning" else content).append(text)
        return Parsed("".join(content), "".join(reasoning), tuple(calls))

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

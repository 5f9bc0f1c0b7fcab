"""Splits a sample's generated text into reasoning, content and tool calls as it streams.

The markers are the model's own, as mlx-lm's `TokenizerWrapper` detects them: thinking
(`think_start` ... `think_end`, e.g. <think>...</think>) and tool calls (tools.CallFormat).
mlx-lm's `TextStateMachine` does the splitting: text that may be the start of a marker
is held back until it is known not to be, so markup never reaches the content.
"""

import json
import logging
import re
import uuid
from typing import List, NamedTuple, Optional, Sequence, Tuple

from mlx_lm.generate import TextStateMachine

from .tools import CallFormat, FunctionCall, Tool, ToolCall

log = logging.getLogger(__name__)


class CallPiece(NamedTuple):
    """A piece of a tool call as it streams: the first names it (`id`, `name`), later ones
    add `arguments` text, the last is `done`. Joined, a call's pieces equal its ToolCall."""

    index: int
    id: Optional[str] = None
    name: Optional[str] = None
    arguments: str = ""
    done: bool = False


class Parsed(NamedTuple):
    content: str = ""
    reasoning: str = ""
    calls: Tuple[ToolCall, ...] = ()  # completed calls
    pieces: Tuple[CallPiece, ...] = ()  # the same calls as they stream

    def __add__(self, other: "Parsed") -> "Parsed":
        return Parsed(self.content + other.content, self.reasoning + other.reasoning, self.calls + other.calls,
                      self.pieces + other.pieces)


# A JSON call's head, up to where its arguments begin: {"name": "...", "arguments":
_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*')
_TAIL = re.compile(r"[\s}]*$")  # may close the call's object: held back until the call ends


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
        self._streamed: Optional[Tuple[str, str, int]] = None  # the open call's (id, name, argument chars sent)
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
            parsed += self._end_call()
        return parsed

    def whole(self, text: str, reason: Optional[str]) -> Parsed:
        return self.feed(text) + self.finish(reason)

    def _collect(self, segments) -> Parsed:
        content, reasoning, calls = [], [], Parsed()
        for state, text in segments:
            if state == "tool":
                self._call_text = (self._call_text or "") + text
                calls += self._stream_call()
                continue
            if self._call_text is not None:  # a call just ended
                calls += self._end_call()
            (reasoning if state == "reasoning" else content).append(text)
        return Parsed("".join(content), "".join(reasoning)) + calls

    def _stream_call(self) -> Parsed:
        """The open call's new pieces: its name once its JSON head is complete, then its
        arguments as they come (JSON formats; any other is sent whole when it ends)."""
        if not self.fmt.json_between_tags:
            return Parsed()
        head = _HEAD.match(self._call_text)
        if head is None:
            return Parsed()
        pieces = []
        if self._streamed is None:
            self._streamed = (f"call_{uuid.uuid4().hex[:24]}", json.loads(f'"{head.group(1)}"'), 0)
            pieces.append(CallPiece(self.num_calls, self._streamed[0], self._streamed[1]))
        cid, name, sent = self._streamed
        args = self._call_text[head.end():]
        ready = len(args) - len(_TAIL.search(args).group())
        if ready > sent:
            pieces.append(CallPiece(self.num_calls, arguments=args[sent:ready]))
            self._streamed = (cid, name, ready)
        return Parsed(pieces=tuple(pieces))

    def _end_call(self) -> Parsed:
        text, streamed = self._call_text, self._streamed
        self._call_text, self._streamed = None, None
        calls = self._parse(text)
        if streamed is not None and len(calls) == 1:  # the raw arguments as streamed (they parse)
            cid, name, sent = streamed
            args = text[_HEAD.match(text).end():].rstrip()
            args = args[:-1].rstrip() if args.endswith("}") else args
            calls[0] = ToolCall(id=cid, function=FunctionCall(name=name, arguments=args))
            piece = CallPiece(self.num_calls - 1, arguments=args[sent:], done=True)
            return Parsed(calls=(calls[0],), pieces=(piece,))
        # Not streamed (another format, or a call that did not parse): each call in one piece.
        first = self.num_calls - len(calls)
        return Parsed(calls=tuple(calls), pieces=tuple(CallPiece(first + i, c.id, c.function.name,
                                                                 c.function.arguments, True)
                                                       for i, c in enumerate(calls)))

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

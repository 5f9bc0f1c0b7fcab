"""gpt-oss's harmony output format: the reply is a run of messages, each a header and a
body (`<|channel|>analysis<|message|>...<|end|><|start|>assistant<|channel|>final
<|message|>...`). The analysis channel is reasoning, final (and commentary addressed to
no one) is content, and commentary addressed `to=functions.NAME` is a tool call whose body
is its JSON arguments; the call ends at `<|call|>`, a stop token.

mlx-lm has no parser for it, and the `openai-harmony` package needs its tokenizer files
downloaded at run time; this one works on the detokenized text, as the OutputParser does.
"""

import re
import uuid
from typing import Optional

from .output_parser import CallPiece, Parsed
from .tools import FunctionCall, ToolCall

MESSAGE, ENDS = "<|message|>", ("<|end|>", "<|call|>", "<|return|>", "<|start|>")
MAX_HEADER = 256  # longer text before any <|message|> is not harmony: it is content


def is_harmony(tokenizer) -> bool:
    vocab = tokenizer.get_vocab()
    return all(m in vocab for m in ("<|start|>", "<|channel|>", "<|message|>", "<|end|>"))


def _held_back(text: str) -> int:
    """How many trailing characters may be the start of a marker."""
    for n in range(min(len(text), max(map(len, ENDS)) - 1), 0, -1):
        if any(m.startswith(text[-n:]) for m in ENDS):
            return n
    return 0


class HarmonyParser:
    """One sample's harmony text -> reasoning, content and tool calls, as it streams
    (the OutputParser interface)."""

    def __init__(self):
        self.buf = ""  # text not yet routed (a header is kept whole until its <|message|>)
        self.in_body = False
        self.channel, self.function = "final", None
        self.call_args = ""
        self.num_messages = self.num_calls = 0
        self.plain = False  # no harmony structure at all: every character is content

    def feed(self, text: str) -> Parsed:
        self.buf += text
        out = Parsed()
        while self.buf:
            if self.plain:
                out, self.buf = out + Parsed(self.buf), ""
            elif not self.in_body:
                i = self.buf.find(MESSAGE)
                if i < 0:
                    self.plain = self.num_messages == 0 and len(self.buf) > MAX_HEADER
                    if not self.plain:
                        break
                    continue
                self._open(self.buf[:i])
                self.buf = self.buf[i + len(MESSAGE):]
            else:
                ends = [(self.buf.find(m), m) for m in ENDS if m in self.buf]
                if not ends:
                    keep = _held_back(self.buf)
                    out += self._route(self.buf[: len(self.buf) - keep])
                    self.buf = self.buf[len(self.buf) - keep:]
                    break
                j, marker = min(ends)
                out += self._route(self.buf[:j]) + self._close()
                self.buf = self.buf[j:] if marker == "<|start|>" else self.buf[j + len(marker):]
        return out

    def finish(self, reason: Optional[str]) -> Parsed:
        """The rest: a body cut short (a call ends at <|call|>, a stop token, so it ends
        here), or text that never became harmony; a partial header is dropped."""
        rest, self.buf = self.buf, ""
        if self.plain or (not self.in_body and self.num_messages == 0):
            return Parsed(rest)
        return self._route(rest) + self._close() if self.in_body else Parsed()

    def whole(self, text: str, reason: Optional[str]) -> Parsed:
        return self.feed(text) + self.finish(reason)

    def _open(self, header: str) -> None:
        channel = re.search(r"<\|channel\|>(\w+)", header)
        recipient = re.search(r"to=functions\.([\w.-]+)", header)
        self.channel = channel.group(1) if channel else "final"
        self.function = recipient.group(1) if recipient else None
        self.in_body, self.call_args = True, ""
        self.num_messages += 1

    def _route(self, text: str) -> Parsed:
        if not text:
            return Parsed()
        if self.function:
            self.call_args += text
            return Parsed()
        return Parsed(reasoning=text) if self.channel == "analysis" else Parsed(text)

    def _close(self) -> Parsed:
        self.in_body = False
        function, self.function = self.function, None
        if not function:
            return Parsed()
        self.num_calls += 1
        call = ToolCall(id=f"call_{uuid.uuid4().hex[:24]}",
                        function=FunctionCall(name=function, arguments=self.call_args.strip() or "{}"))
        piece = CallPiece(self.num_calls - 1, call.id, function, call.function.arguments, done=True)
        return Parsed(calls=(call,), pieces=(piece,))

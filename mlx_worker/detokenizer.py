"""Incremental detokenization: UTF-8 safe deltas and stop strings that never leak."""

from typing import List, Optional, Sequence


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas.

    Decodes a small window of recent tokens and emits what it adds, holding back a
    trailing U+FFFD (a multi-byte character split across tokens) until it completes.
    With stop strings, it also holds back the longest tail that could start one, and
    stops at the first match without emitting any of it.
    """

    def __init__(self, tokenizer, prompt_ids: Sequence[int] = (), stop: Sequence[str] = ()):
        self.tok = tokenizer
        self.ids: List[int] = list(prompt_ids[-4:])  # context so leading spaces decode right
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.stop = [s for s in stop if s]
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.text = ""  # all text so far, including held-back characters
        self.emitted = 0  # characters of self.text already returned
        self.stopped: Optional[str] = None

    def _decode(self, ids) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)

    def add(self, token_ids: Sequence[int]) -> str:
        """Append tokens; returns the new text that is safe to show."""
        if self.stopped is not None:
            return ""
        self.ids.extend(token_ids)
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            new = full[len(prefix) :]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            start = max(0, len(self.text) - self.hold)  # a stop may straddle old text
            self.text += new
            hits = [(i, s) for s in self.stop if (i := self.text.find(s, start)) != -1]
            if hits:
                i, self.stopped = min(hits)
                self.text = self.text[:i]
                return self._take(len(self.text))
        return self._take(len(self.text) - self.hold if self.stop else len(self.text))

    def flush(self) -> str:
        """The held-back text, once the stream ended without a stop string."""
        return self._take(len(self.text))

    def _take(self, upto: int) -> str:
        upto = max(upto, self.emitted)
        out = self.text[self.emitted : upto]
        self.emitted = upto
        return out

"""Incremental detokenization: UTF-8 safe deltas and stop strings that never leak."""

from typing import List, Optional, Sequence

from tokenizers.decoders import DecodeStream


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas.

    Decodes a small window of recent tokens and emits what it adds, holding back a
    trailing U+FFFD (a multi-byte character split across tokens) until it completes;
    the `tokenizers` library's own `DecodeStream` does that when the tokenizer is one of
    its Rust objects (one call per step instead of two decodes). With stop strings, it
    also holds back the longest tail that could start one, and stops at the first match
    without emitting any of it.
    """

    def __init__(self, tokenizer, prompt_ids: Sequence[int] = (), stop: Sequence[str] = ()):
        self._decode = _decoder(tokenizer)
        self.ids: List[int] = list(prompt_ids[-4:])  # context so leading spaces decode right
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self._rust = getattr(self._decode, "rust", None)  # the `tokenizers` object, when there is one
        self._stream = DecodeStream(list(self.ids), skip_special_tokens=True) if self._rust else None
        self.stop = [s for s in stop if s]
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.text = ""  # all text so far, including held-back characters
        self.emitted = 0  # characters of self.text already returned
        self.stopped: Optional[str] = None

    def add(self, token_ids: Sequence[int]) -> str:
        """Append tokens; returns the new text that is safe to show."""
        if self.stopped is not None:
            return ""
        new = self._step(token_ids)
        if new:
            start = max(0, len(self.text) - self.hold)  # a stop may straddle old text
            self.text += new
            hits = [(i, s) for s in self.stop if (i := self.text.find(s, start)) != -1]
            if hits:
                i, self.stopped = min(hits)
                self.text = self.text[:i]
                return self._take(len(self.text))
        return self._take(len(self.text) - self.hold if self.stop else len(self.text))

    def _step(self, token_ids: Sequence[int]) -> str:
        """The text `token_ids` complete ("" while a character is still partial)."""
        if self._stream is not None:
            return self._stream.step(self._rust, list(token_ids)) or ""
        self.ids.extend(token_ids)
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            return full[len(prefix) :]
        return ""

    def flush(self) -> str:
        """The held-back text, once the stream ended without a stop string."""
        return self._take(len(self.text))

    def _take(self, upto: int) -> str:
        upto = max(upto, self.emitted)
        out = self.text[self.emitted : upto]
        self.emitted = upto
        return out


def _decoder(tokenizer):
    """`tokenizer.decode(ids, skip_special_tokens=True)`, straight from the `tokenizers`
    Rust object when transformers' wrapper would add nothing to it (no clean-up of
    spaces): a third of the cost, paid for every token of every stream."""
    hf = getattr(tokenizer, "_tokenizer", tokenizer)  # mlx-lm's TokenizerWrapper wraps transformers'
    rust = getattr(hf, "_tokenizer", None)
    if rust is not None and hasattr(rust, "decode") and getattr(hf, "clean_up_tokenization_spaces", None) is False:
        def rust_decode(ids):
            return rust.decode(ids, skip_special_tokens=True)
        rust_decode.rust = rust
        return rust_decode

    def wrapper_decode(ids):
        return tokenizer.decode(ids, skip_special_tokens=True)
    return wrapper_decode

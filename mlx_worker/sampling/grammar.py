"""Structured output: token masks from JSON schemas, regexes and choices.

Backed by llguidance (Rust, no torch). One ``GrammarCompiler`` per engine wraps
the tokenizer; ``compile(spec)`` returns a cached ``Grammar``; each constrained
request gets its own ``Matcher`` from ``Grammar.new_matcher()``. Per decode step:

    mask = matcher.allowed()                      # np.bool_ (vocab_size,)
    logits = mx.where(mx.array(mask), logits, -mx.inf)
    ...sample tok...
    matcher.advance(tok)                          # then stop if matcher.is_terminated()

EOS (every id in the tokenizer's ``eos_token_ids``) is allowed exactly when the
grammar can end; special tokens are never allowed; ids past the tokenizer's
vocabulary (logits padding) are never allowed.
"""

import json
import logging
import threading
from collections import OrderedDict
from typing import Any, Dict, Iterable, List, Optional, Sequence

import llguidance as llg
import numpy as np
from pydantic import BaseModel, ConfigDict, model_validator

logger = logging.getLogger(__name__)

__all__ = ["GrammarSpec", "GrammarCompiler", "Grammar", "Matcher", "batch_allowed"]

_KINDS = ("json_schema", "json_object", "regex", "choice")

# JSON layout when the compiler has no json_whitespace: one line, json.dumps style
# ({"a": 1, "b": [2, 3]}). Flexible whitespace lets models (and random policies)
# emit unbounded runs of spaces and newlines.
_COMPACT_JSON = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class GrammarSpec(BaseModel):
    """What the output must match: exactly one of the fields.

    Args:
        json_schema: a JSON schema (properties are generated in the given order).
        json_object: any JSON object.
        regex: a regex (Rust ``regex`` syntax) the whole output must match.
        choice: the output is one of these strings.
        prefix, suffix: with json_schema, literal text around the JSON (e.g. a tool call's
            markers: ``<tool_call>{...}</tool_call>``).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    json_schema: Optional[Dict[str, Any]] = None
    json_object: bool = False
    regex: Optional[str] = None
    choice: Optional[List[str]] = None
    prefix: str = ""
    suffix: str = ""

    @model_validator(mode="after")
    def _exactly_one(self) -> "GrammarSpec":
        if (self.prefix or self.suffix) and self.kind() != "json_schema":
            raise ValueError("GrammarSpec.prefix and suffix go with json_schema only")
        self.kind()
        return self

    def kind(self) -> str:
        """The one field that is set; ``ValueError`` unless exactly one is."""
        set_ = [k for k in _KINDS if (getattr(self, k) is not False and getattr(self, k) is not None)]
        if len(set_) != 1:
            got = ", ".join(set_) if set_ else "none"
            raise ValueError(f"GrammarSpec needs exactly one of {', '.join(_KINDS)}; got {got}")
        if set_[0] == "choice" and not self.choice:
            raise ValueError("GrammarSpec.choice must be a non-empty list of strings")
        return set_[0]


def _hf_tokenizer(tokenizer):
    hf = getattr(tokenizer, "_tokenizer", tokenizer)  # mlx-lm TokenizerWrapper or HF tokenizer
    backend = getattr(hf, "backend_tokenizer", None)
    if backend is None:
        if hasattr(hf, "to_str"):  # a bare tokenizers.Tokenizer
            return hf, hf
        raise ValueError("GrammarCompiler needs a fast (tokenizers-backed) tokenizer")
    return hf, backend


class GrammarCompiler:
    """Compiles and caches grammars for one tokenizer.

    Args:
        tokenizer: the mlx-lm ``TokenizerWrapper`` (or a fast HF tokenizer).
        vocab_size: width of the model's logits; may exceed the tokenizer's
          vocabulary (the extra ids are never allowed). Default: the tokenizer's.
        eos_token_ids: ids allowed when the grammar can end. Default: the
          wrapper's ``eos_token_ids`` (the engine's stop ids), else ``eos_token_id``.
        json_whitespace: regex for the whitespace allowed between JSON tokens,
          e.g. ``r"[ \\n]{0,8}"``. Default ``None``: single-line ``", "`` / ``": "`` layout.
        cache_size: compiled grammars kept (LRU).
    """

    def __init__(
        self,
        tokenizer,
        vocab_size: Optional[int] = None,
        eos_token_ids: Optional[Iterable[int]] = None,
        json_whitespace: Optional[str] = None,
        cache_size: int = 256,
    ):
        hf, backend = _hf_tokenizer(tokenizer)
        if eos_token_ids is None:
            eos_token_ids = getattr(tokenizer, "eos_token_ids", None) or []
            if not eos_token_ids and getattr(hf, "eos_token_id", None) is not None:
                eos_token_ids = [hf.eos_token_id]
        if isinstance(eos_token_ids, int):
            eos_token_ids = [eos_token_ids]
        self.eos_token_ids = sorted({int(t) for t in eos_token_ids})
        if not self.eos_token_ids:
            raise ValueError("GrammarCompiler needs at least one EOS token id")
        n_tok = max(backend.get_vocab(with_added_tokens=True).values()) + 1
        self.vocab_size = int(vocab_size) if vocab_size is not None else n_tok
        self.ll_tokenizer = llg.LLTokenizer(
            backend.to_str(), n_vocab=max(self.vocab_size, n_tok), eos_token=self.eos_token_ids
        )
        if json_whitespace is None:
            self.json_options = dict(_COMPACT_JSON)
        else:
            self.json_options = {"whitespace_flexible": True, "whitespace_pattern": json_whitespace}
        self._limits = llg.LLParserLimits(verbose_errors=False)
        self._cache: "OrderedDict[str, Grammar]" = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()

    def _grammar_text(self, spec: GrammarSpec) -> str:
        kind = spec.kind()
        if spec.prefix or spec.suffix:  # ours are defaults: a schema's own "x-guidance" options win
            schema = json.dumps({"x-guidance": self.json_options, **spec.json_schema}, ensure_ascii=False)
            rule = " ".join([json.dumps(spec.prefix)] * bool(spec.prefix) + ["body"] + [json.dumps(spec.suffix)] * bool(spec.suffix))
            return llg.LLMatcher.grammar_from_lark(f"start: {rule}\nbody: %json {schema}")
        if kind == "json_schema" or kind == "json_object":
            schema = spec.json_schema if kind == "json_schema" else {"type": "object"}
            # ours are defaults: a schema's own "x-guidance" options win
            return llg.LLMatcher.grammar_from_json_schema(schema, defaults=self.json_options)
        if kind == "regex":
            return llg.LLMatcher.grammar_from_regex(spec.regex)
        alts = " | ".join(json.dumps(c, ensure_ascii=False) for c in dict.fromkeys(spec.choice))
        return llg.LLMatcher.grammar_from_lark("start: " + alts)

    def compile(self, spec: GrammarSpec) -> "Grammar":
        """The ``Grammar`` for ``spec`` (cached); ``ValueError`` if it is invalid."""
        if not isinstance(spec, GrammarSpec):
            spec = GrammarSpec.model_validate(spec)
        key = spec.model_dump_json()  # keeps key order: property order matters
        with self._lock:
            g = self._cache.get(key)
            if g is not None:
                self._cache.move_to_end(key)
                return g
        kind = spec.kind()
        try:
            text = self._grammar_text(spec)
        except ValueError as e:
            raise ValueError(f"invalid {kind}: {e}") from None
        template = llg.LLMatcher(self.ll_tokenizer, text, log_level=0, limits=self._limits)
        if template.is_error():
            raise ValueError(f"invalid {kind}: {template.get_error().strip()}")
        for w in template.get_grammar_warnings():
            logger.debug("grammar warning (%s): %s", kind, w)
        g = Grammar(self, spec, template)
        g.new_matcher().allowed()  # builds the lexer states the copies share (first mask ~2 ms)
        with self._lock:
            self._cache[key] = g
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return g


class Grammar:
    """A compiled grammar; immutable, shared by the matchers it makes."""

    def __init__(self, compiler: GrammarCompiler, spec: GrammarSpec, template: "llg.LLMatcher"):
        self.spec = spec
        self.vocab_size = compiler.vocab_size
        self.eos_token_ids = compiler.eos_token_ids
        self._ll_vocab = compiler.ll_tokenizer.vocab_size
        self._template = template

    def new_matcher(self) -> "Matcher":
        """A fresh matcher at the start of the output."""
        return Matcher(self, self._template.deep_copy())


class Matcher:
    """Per-request grammar state: which token may come next."""

    def __init__(self, grammar: Grammar, ll_matcher: "llg.LLMatcher"):
        self.grammar = grammar
        self.vocab_size = grammar.vocab_size
        self._m = ll_matcher
        self._bits = np.zeros((grammar._ll_vocab + 31) // 32, dtype=np.int32)

    def _fill_bits(self) -> np.ndarray:
        self._m.unsafe_compute_mask_ptr(self._bits.ctypes.data, self._bits.nbytes)
        return self._bits

    def allowed(self, mask_out: Optional[np.ndarray] = None) -> np.ndarray:
        """Bool mask of the tokens allowed next, shape ``(vocab_size,)``.

        Args:
            mask_out: optional bool array of that shape (e.g. a row of a batch
              mask) to write into; returned.
        """
        return _unpack(self._fill_bits(), self.vocab_size, mask_out)

    def advance(self, token_id: int) -> bool:
        """Consume ``token_id``; ``False`` (state unchanged) if it is not allowed."""
        token_id = int(token_id)
        if not 0 <= token_id < self.vocab_size or token_id >= self.grammar._ll_vocab:
            return False
        if self._m.is_stopped():  # complete: only EOS, which changes nothing
            return token_id in self.grammar.eos_token_ids and not self._m.is_error()
        if self._m.validate_tokens([token_id]) != 1:  # consuming a bad token would poison the matcher
            return False
        return self._m.consume_token(token_id)

    def is_terminated(self) -> bool:
        """The output is complete: only EOS is allowed (or EOS was consumed)."""
        return self._m.is_stopped()

    def is_accepting(self) -> bool:
        """The output may end here (EOS is allowed)."""
        return self._m.is_accepting()

    def forced_tokens(self) -> List[int]:
        """Tokens the grammar forces next (for jump-forward decoding); may be empty."""
        return list(self._m.compute_ff_tokens())

    def rollback(self, num_tokens: int = 1) -> bool:
        """Undo the last ``num_tokens`` advances (e.g. rejected draft tokens)."""
        return self._m.rollback(num_tokens)

    def reset(self) -> bool:
        """Back to the start of the output."""
        return self._m.reset()

    @property
    def error(self) -> str:
        """Internal error ('' if none); an errored matcher allows only EOS."""
        return self._m.get_error()


def _unpack(bits: np.ndarray, vocab_size: int, out: Optional[np.ndarray]) -> np.ndarray:
    # bit i of little-endian u32 word w is token 32*w + i (~6 us for 49k tokens)
    mask = np.unpackbits(bits.view(np.uint8), count=vocab_size, bitorder="little").view(np.bool_)
    if out is None:
        return mask
    np.copyto(out, mask)
    return out


_executor = None


def batch_allowed(matchers: Sequence[Matcher], mask_out: Optional[np.ndarray] = None) -> np.ndarray:
    """``(len(matchers), vocab_size)`` bool masks, computed in parallel off the GIL."""
    global _executor
    if not matchers:
        raise ValueError("batch_allowed needs at least one matcher")
    if _executor is None:
        _executor = llg.LLExecutor()
    vocab_size = matchers[0].vocab_size
    bits = np.zeros((len(matchers), matchers[0]._bits.shape[0]), dtype=np.int32)
    _executor.unsafe_compute_mask_ptr(
        [(m._m, i) for i, m in enumerate(matchers)], bits.ctypes.data, bits.shape[1] * 4, len(matchers)
    )
    if mask_out is None:
        mask_out = np.empty((len(matchers), vocab_size), dtype=np.bool_)
    for i in range(len(matchers)):
        _unpack(bits[i], vocab_size, mask_out[i])
    return mask_out

"""Constrained decoding (mlx_worker.sampling.grammar) on the default model's real tokenizer.

A model-free random policy drives each matcher: at every step it samples one of the
allowed tokens with a fixed seed, so whatever the grammar lets through is exercised.
"""

import json
import re
import time

import numpy as np
import pytest

import mlx_worker  # noqa: F401  (OpenBLAS before mlx)
from mlx_worker.models.gguf import default_model_path
from mlx_worker.sampling.grammar import GrammarCompiler, GrammarSpec, batch_allowed

jsonschema = pytest.importorskip("jsonschema")

MAX_STEPS = 200

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "score": {"type": "number"},
        "code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"},
        "color": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 3},
        "owner": {
            "type": "object",
            "properties": {"id": {"type": "integer"}, "admin": {"type": "boolean"}},
            "required": ["id", "admin"],
            "additionalProperties": False,
        },
        "parent": {"anyOf": [{"type": "null"}, {"type": "integer", "minimum": 1}]},
    },
    "required": ["name", "age", "code", "owner"],
    "additionalProperties": False,
}

REGEXES = [
    r"[a-z]{3,8}@[a-z]{2,6}\.(com|org|net)",
    r"\d{3}-\d{4}",
    r"(yes|no|maybe)( [0-9]{1,3}%)?",
    r"-?(0|[1-9][0-9]{0,5})(\.[0-9]{1,3})?",
    r"[A-Za-z ]{1,20}",
]

CHOICES = ["yes", "yes please", "no", 'say "hi" \\ now', "naïve 日本\n"]


@pytest.fixture(scope="module")
def tok():
    from mlx_lm.tokenizer_utils import load

    return load(default_model_path())


@pytest.fixture(scope="module")
def compiler(tok):
    return GrammarCompiler(tok, vocab_size=tok._tokenizer.vocab_size)


def decode(compiler, toks):
    return compiler.ll_tokenizer.decode_bytes(toks).decode("utf-8")


def walk(compiler, matcher, seed, prefer=None, times=None):
    """Random allowed tokens until terminated, EOS or MAX_STEPS; returns the text."""
    rng = np.random.default_rng(seed)
    eos = compiler.eos_token_ids
    banned = [t for t in SPECIAL_IDS if t not in eos]
    toks = []
    for _ in range(MAX_STEPS):
        t0 = time.perf_counter()
        mask = matcher.allowed()
        if times is not None:
            times.append(time.perf_counter() - t0)
        assert mask.shape == (compiler.vocab_size,) and mask.dtype == np.bool_
        assert not mask[banned].any(), "special tokens must never be allowed"
        assert mask[eos].all() == matcher.is_accepting()
        ids = np.flatnonzero(mask & prefer) if prefer is not None else np.array([], dtype=np.int64)
        if ids.size == 0:
            ids = np.flatnonzero(mask)
        tok_id = int(rng.choice(ids))
        assert matcher.advance(tok_id)
        if tok_id in eos:
            break
        toks.append(tok_id)
        if matcher.is_terminated():
            break
    mask = matcher.allowed()
    assert mask[eos].all(), f"EOS not allowed after {len(toks)} steps: {decode(compiler, toks)!r}"
    return decode(compiler, toks)


SPECIAL_IDS = []  # the tokenizer's special added tokens, filled by _special_ids


@pytest.fixture(scope="module", autouse=True)
def _special_ids(tok, compiler):
    SPECIAL_IDS[:] = sorted(i for i, t in tok._tokenizer.added_tokens_decoder.items() if t.special)
    assert set(SPECIAL_IDS) - set(compiler.eos_token_ids), "expected non-EOS special tokens (<|im_start|>...)"


@pytest.mark.parametrize("seed", range(6))
def test_json_schema_random_walk(compiler, seed):
    text = walk(compiler, compiler.compile(GrammarSpec(json_schema=SCHEMA)).new_matcher(), seed)
    jsonschema.validate(json.loads(text), SCHEMA)


@pytest.fixture(scope="module")
def json_alphabet(compiler):
    """Short tokens made of JSON punctuation and a few letters: strings close quickly."""
    alpha = set(b'{}[]",: 0123456789abenlrstu-.')
    texts = [compiler.ll_tokenizer.decode_bytes([i]) for i in range(compiler.vocab_size)]
    return np.array([0 < len(t) <= 2 and set(t) <= alpha for t in texts])


@pytest.mark.parametrize("seed", range(8))
def test_json_object_random_walk(compiler, json_alphabet, seed):
    m = compiler.compile(GrammarSpec(json_object=True)).new_matcher()
    text = walk(compiler, m, seed, prefer=json_alphabet)
    assert isinstance(json.loads(text), dict)


@pytest.mark.parametrize("regex", REGEXES)
@pytest.mark.parametrize("seed", range(3))
def test_regex_random_walk(compiler, regex, seed):
    text = walk(compiler, compiler.compile(GrammarSpec(regex=regex)).new_matcher(), seed)
    assert re.fullmatch(regex, text), text


@pytest.mark.parametrize("seed", range(10))
def test_choice_random_walk(compiler, seed):
    text = walk(compiler, compiler.compile(GrammarSpec(choice=CHOICES)).new_matcher(), seed)
    assert text in CHOICES


def test_eos_exactly_when_grammar_can_end(tok, compiler):
    hf = tok._tokenizer
    eos = compiler.eos_token_ids
    assert eos == sorted(tok.eos_token_ids)
    m = compiler.compile(GrammarSpec(choice=["yes", "yes please"])).new_matcher()
    assert not m.allowed()[eos].any() and not m.is_accepting()
    for t in hf.encode("yes", add_special_tokens=False):
        assert m.advance(t)
    mask = m.allowed()
    assert mask[eos].all() and mask.sum() > len(eos)  # may end or go on
    assert m.is_accepting() and not m.is_terminated()
    for t in hf.encode(" please", add_special_tokens=False):
        assert m.advance(t)
    assert m.is_terminated()
    assert np.flatnonzero(m.allowed()).tolist() == eos  # only EOS
    assert m.advance(eos[0]) and m.is_terminated()


def test_disallowed_token_is_refused_and_state_kept(tok, compiler):
    hf = tok._tokenizer
    m = compiler.compile(GrammarSpec(json_schema=SCHEMA)).new_matcher()
    before = m.allowed().copy()
    bad = hf.encode("hello", add_special_tokens=False)[0]
    assert not before[bad]
    assert m.advance(bad) is False
    assert m.advance(compiler.eos_token_ids[0]) is False  # cannot end before "{...}"
    assert m.advance(tok.convert_tokens_to_ids("<|im_start|>")) is False
    assert m.advance(-1) is False and m.advance(compiler.vocab_size) is False
    assert m.error == ""
    np.testing.assert_array_equal(m.allowed(), before)
    assert m.advance(hf.encode("{", add_special_tokens=False)[0])


def test_vocab_padding_never_allowed(tok):
    n = tok._tokenizer.vocab_size
    c = GrammarCompiler(tok, vocab_size=n + 64)
    m = c.compile(GrammarSpec(regex=r"[a-z ]+")).new_matcher()
    for _ in range(5):
        mask = m.allowed()
        assert mask.shape == (n + 64,) and mask[:n].any() and not mask[n:].any()
        assert not m.advance(n + 3)
        assert m.advance(int(np.flatnonzero(mask)[0]))


def test_allowed_into_out_and_batch(compiler):
    g1 = compiler.compile(GrammarSpec(json_schema=SCHEMA))
    g2 = compiler.compile(GrammarSpec(regex=REGEXES[0]))
    ms = [g1.new_matcher(), g2.new_matcher(), g1.new_matcher()]
    ms[2].advance(int(np.flatnonzero(ms[2].allowed())[0]))
    out = np.zeros((3, compiler.vocab_size), dtype=np.bool_)
    assert np.shares_memory(ms[0].allowed(out[1]), out[1])
    np.testing.assert_array_equal(out[1], ms[0].allowed())
    batch = batch_allowed(ms)
    for i, m in enumerate(ms):
        np.testing.assert_array_equal(batch[i], m.allowed())
    assert batch_allowed(ms, out) is out and (out == batch).all()


def test_rollback_reset_and_forced_tokens(tok, compiler):
    hf = tok._tokenizer
    m = compiler.compile(GrammarSpec(json_schema=SCHEMA)).new_matcher()
    start = m.allowed().copy()
    assert decode(compiler, m.forced_tokens()).startswith('{"name":')  # the first key is required
    toks = hf.encode('{"name": "Bo", "age": 7', add_special_tokens=False)
    for t in toks:
        assert m.advance(t)
    after = m.allowed().copy()
    assert m.advance(hf.encode(",", add_special_tokens=False)[0])
    assert m.rollback(1)
    np.testing.assert_array_equal(m.allowed(), after)
    assert m.reset()
    np.testing.assert_array_equal(m.allowed(), start)


def test_compile_cache(compiler):
    spec = GrammarSpec(json_schema=SCHEMA)
    g = compiler.compile(spec)
    assert compiler.compile(GrammarSpec(json_schema=json.loads(json.dumps(SCHEMA)))) is g
    assert compiler.compile({"json_schema": SCHEMA}) is g
    reordered = {"type": "object", "properties": dict(reversed(list(SCHEMA["properties"].items())))}
    assert compiler.compile(GrammarSpec(json_schema=reordered)) is not g  # property order is output order
    m1, m2 = g.new_matcher(), g.new_matcher()
    assert m1.advance(int(np.flatnonzero(m1.allowed())[0]))
    assert not np.array_equal(m1.allowed(), m2.allowed())  # independent states


@pytest.mark.parametrize(
    "spec, match",
    [
        (dict(json_schema={"type": "foo"}), "(?s)invalid json_schema.*foo"),
        (dict(json_schema={"type": "integer", "minimum": 5, "maximum": 1}), "(?s)invalid json_schema.*[Uu]nsatisfiable"),
        (dict(json_schema={"type": "string", "pattern": "(a"}), "(?s)invalid json_schema.*unclosed group"),
        (dict(json_schema={"$ref": "#/definitions/missing"}), "invalid json_schema"),
        (dict(regex="(ab"), "(?s)invalid regex.*unclosed group"),
        (dict(regex="a(?=b)"), "invalid regex"),
    ],
)
def test_invalid_grammar_raises(compiler, spec, match):
    with pytest.raises(ValueError, match=match):
        compiler.compile(GrammarSpec(**spec))


@pytest.mark.parametrize(
    "spec, match",
    [
        (dict(choice=[]), "non-empty"),
        (dict(), "exactly one.*got none"),
        (dict(regex="a", choice=["a"]), "exactly one.*got regex, choice"),
        (dict(json_object=True, json_schema={"type": "object"}), "exactly one"),
        (dict(regexp="a"), "regexp"),
    ],
)
def test_invalid_spec_raises(compiler, spec, match):
    with pytest.raises(ValueError, match=match):
        compiler.compile(spec)
    with pytest.raises(ValueError, match=match):
        GrammarSpec(**spec)


def test_hf_tokenizer_and_json_whitespace(tok):
    c = GrammarCompiler(tok._tokenizer, json_whitespace=r"[ \n]{0,4}")
    assert c.eos_token_ids == [tok._tokenizer.eos_token_id] and c.vocab_size == tok._tokenizer.vocab_size
    m = c.compile(GrammarSpec(json_schema={"type": "object", "properties": {"a": {"type": "boolean"}}, "required": ["a"], "additionalProperties": False})).new_matcher()
    text = walk(c, m, seed=0)
    assert json.loads(text) in ({"a": True}, {"a": False})


def test_mask_cost(compiler):
    """Time allowed() per decode step on the JSON schema (printed with -s)."""
    t0 = time.perf_counter()
    g = compiler.compile(GrammarSpec(json_schema={**SCHEMA, "title": "fresh"}))  # not cached, cold lexer
    compile_ms = (time.perf_counter() - t0) * 1e3
    times = []
    seed = 100
    while len(times) < 200:
        walk(compiler, g.new_matcher(), seed, times=times)
        seed += 1
    us = np.array(times) * 1e6
    print(
        f"\ncompile {compile_ms:.1f} ms; allowed() on JSON schema, vocab {compiler.vocab_size}: {us.size} steps, "
        f"mean {us.mean():.0f} us, median {np.median(us):.0f} us, p99 {np.percentile(us, 99):.0f} us, max {us.max():.0f} us"
    )
    assert us.mean() < 5000  # generous: the machine is shared

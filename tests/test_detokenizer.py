"""Incremental detokenization with the default model's real tokenizer."""

import pytest
from conftest import default_tokenizer

from mlx_worker.sampling.detokenizer import IncrementalDetokenizer

TEXT = "Héllo wörld! 日本語のテキスト 🚀🎉 naïve café, then: stop here please."


@pytest.fixture(scope="module")
def tok():
    return default_tokenizer()


def stream(tok, text, stop=()):
    ids = tok.encode(text, add_special_tokens=False)
    d = IncrementalDetokenizer(tok, [], stop)
    deltas = [d.add([i]) for i in ids]
    if d.stopped is None:
        deltas.append(d.flush())
    return deltas, d


def test_deltas_join_to_the_full_text_and_never_split_characters(tok):
    deltas, _ = stream(tok, TEXT)
    assert "".join(deltas) == TEXT
    assert not any("\ufffd" in x for x in deltas)
    assert sum(1 for x in deltas if x == "") > 0  # some tokens were partial characters


def test_stop_string_split_across_tokens_is_never_emitted(tok):
    ids = tok.encode(TEXT, add_special_tokens=False)
    stop = "p here"
    pieces = [tok.decode([i]) for i in ids]
    assert stop not in pieces  # the stop spans several tokens
    deltas, d = stream(tok, TEXT, stop=[stop, "zzz"])
    assert "".join(deltas) == TEXT[: TEXT.index(stop)]
    assert d.stopped == stop


def test_earliest_stop_string_wins(tok):
    deltas, d = stream(tok, TEXT, stop=["please", "café"])
    assert d.stopped == "café" and "".join(deltas) == TEXT[: TEXT.index("café")]


def test_leading_space_of_a_continuation_is_kept(tok):
    prompt = tok.encode("Say", add_special_tokens=False)
    ids = tok.encode(" hello there", add_special_tokens=False)
    d = IncrementalDetokenizer(tok, prompt)
    assert "".join(d.add([i]) for i in ids) + d.flush() == " hello there"


def test_the_rust_decoder_gives_what_the_tokenizer_gives(tok):
    from mlx_worker.sampling.detokenizer import _decoder

    fast = _decoder(tok)
    assert fast.__name__ == "rust_decode"  # the default tokenizer takes the fast path
    ids = tok.encode(TEXT + "<|im_end|> and <|im_start|>assistant more", add_special_tokens=False)
    for i in range(len(ids)):
        for j in range(i + 1, min(len(ids), i + 6) + 1):
            assert fast(ids[i:j]) == tok.decode(ids[i:j], skip_special_tokens=True)


def test_the_stream_decoder_and_the_window_decoder_give_the_same_deltas(tok):
    """The default tokenizer streams through `tokenizers`' DecodeStream; the window
    algorithm (any other tokenizer) must give the same deltas, merged steps included."""
    ids = tok.encode(TEXT + " and more 🚀 text", add_special_tokens=False)
    prompt = tok.encode("Say", add_special_tokens=False)
    fast, window = IncrementalDetokenizer(tok, prompt), IncrementalDetokenizer(tok, prompt)
    window._stream = None
    assert fast._stream is not None
    steps, i = [], 0
    while i < len(ids):  # steps of 1, 2 and 3 tokens, as merged outputs bring them
        steps.append(ids[i : i + 1 + len(steps) % 3])
        i += len(steps[-1])
    assert [fast.add(s) for s in steps] == [window.add(s) for s in steps]

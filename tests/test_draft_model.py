"""Speculative method draft: a small model run by the same engine drafts, the target
verifies; the tokens are always the target's (mlx-lm's own greedy generation, or the
same seeded samples as without drafts).

Two tiny draft models bracket acceptance: the target itself (its drafts are right, so
the draft's KV must have kept up with every forward: batching, chunked prefill, prefix
hits, preemption) and a model of other weights (its drafts are wrong: every rejection
path).
"""

import asyncio

import pytest
from conftest import collect, reference_greedy
from test_speculative import prompts, sampled, streams, flat
from tiny_models import make_tiny_model

from mlx_worker import Engine, EngineConfig, Request, SamplingParams

DRAFT = {"method": "draft", "draft_model": "tiny", "adaptive": False}


@pytest.fixture(scope="module")
def target():
    return make_tiny_model("llama")


def engine(target, draft, k=4, **kw):
    kw.setdefault("max_total_tokens", 4096)
    spec = {**DRAFT, "num_draft_tokens": k} if draft is not None else None
    return Engine(EngineConfig(speculative=spec, **kw), model=target, draft_model=draft)


def greedy_run(eng, ps, n, stagger=0.0):
    reqs = [Request(rid=f"g{i}", prompt_ids=p, params=SamplingParams(max_tokens=n, ignore_eos=True, temperature=0.0))
            for i, p in enumerate(ps)]

    async def one(i, r):
        await asyncio.sleep(stagger * i)
        return await collect(eng, r)

    async def main():
        return await asyncio.gather(*[one(i, r) for i, r in enumerate(reqs)])

    return [toks for toks, _ in asyncio.run(main())]


def check(target, eng, ps, n, stagger=0.0):
    outs = greedy_run(eng, ps, n, stagger)
    assert outs == [reference_greedy(target, p, n) for p in ps]
    assert eng.stats()["kv_pages_used"] == 0


def test_the_target_as_its_own_draft_is_always_right(target):
    """Drafts from the draft's own KV: right only if that KV kept up with every forward
    the target ran (prefill chunks of 16 beside verify rows, and the pages of a prefix hit)."""
    shared = prompts(1, 48, 49, seed=20)[0]
    ps = [shared + p for p in prompts(5, 3, 40, seed=21)]
    eng = engine(target, target, max_batched_tokens=16)
    check(target, eng, ps[:1], 20)
    check(target, eng, ps[1:], 20, stagger=0.02)
    st = eng.stats()
    assert st["prefix_hit_tokens"] >= 4 * 48 // 16 * 16
    spec = st["speculative"]
    assert spec["verify_rows"] > 0 and spec["acceptance_rate"] > 0.97, spec
    eng.shutdown()


def test_a_draft_of_other_weights_is_rejected_and_changes_nothing(target):
    other = make_tiny_model("llama", seed=7, num_hidden_layers=1)
    ps = prompts(6, 3, 60, seed=22)
    eng = engine(target, other, k=3)
    check(target, eng, ps, 16, stagger=0.01)
    spec = eng.stats()["speculative"]
    assert spec["verify_rows"] > 0 and spec["accepted_tokens"] < spec["drafted_tokens"]
    eng.shutdown()


def test_seeded_samples_are_the_same_with_a_draft_model(target):
    ps = prompts(4, 5, 50, seed=23)
    off = engine(target, None)
    plain = streams(off, sampled(ps, 14))
    off.shutdown()
    for draft in (target, make_tiny_model("llama", seed=7)):
        eng = engine(target, draft)
        on = streams(eng, sampled(ps, 14))
        assert [flat(o, "token_ids") for o in on] == [flat(o, "token_ids") for o in plain]
        eng.shutdown()


def test_preemption_recomputes_the_draft_kv_too(target):
    ps = prompts(3, 20, 24, seed=24)  # 8 pages of 16 tokens; three requests need 3 x 4 pages
    eng = engine(target, target, max_total_tokens=128, page_size=16)
    check(target, eng, ps, 40)
    st = eng.stats()
    assert st["preemptions"] > 0 and st["speculative"]["acceptance_rate"] > 0.97
    eng.shutdown()


def test_a_draft_model_must_be_attention_only(target):
    with pytest.raises(ValueError, match="recurrent layers"):
        engine(target, make_tiny_model("qwen3_next"))


def test_a_draft_model_by_name_with_the_tokenizer_checked(tmp_path):
    """`draft_model: default` loads the embedded model as the default model's draft (as a
    user names one in app.yaml): a chat answer equals the one without drafts. A draft
    whose tokenizer gives a token another id is refused at startup."""
    import json

    from mlx_worker.models.gguf import default_model_path
    from mlx_worker.models.loader import load_model
    from tiny_models import save_tiny_model

    real, tok = load_model()
    ids = tok.apply_chat_template([{"role": "user", "content": "Repeat exactly: the quick brown fox jumps."}],
                                  add_generation_prompt=True)
    answers = []
    for spec in (None, {"method": "draft", "draft_model": "default"}):
        eng = Engine(EngineConfig(speculative=spec, max_total_tokens=1024), model=real, tokenizer=tok)
        answers.append(greedy_run(eng, [ids], 12)[0])
        if spec:
            assert eng.stats()["speculative"]["accepted_tokens"] > 0
        eng.shutdown()
    assert answers[0] == answers[1]

    other = tmp_path / "tok"
    other.mkdir()
    for f in default_model_path().iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")):
            (other / f.name).write_bytes(f.read_bytes())
    data = json.loads((other / "tokenizer.json").read_text())
    vocab = data["model"]["vocab"]
    a, b = list(vocab)[1000:1002]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (other / "tokenizer.json").write_text(json.dumps(data))
    path = save_tiny_model("llama", tmp_path / "draft", tokenizer_dir=other)
    with pytest.raises(ValueError, match="another tokenizer"):
        Engine(EngineConfig(speculative={"method": "draft", "draft_model": str(path)}, max_total_tokens=1024),
               model=real, tokenizer=tok)

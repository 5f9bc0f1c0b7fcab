"""Speculative decoding: verified drafts give exactly the tokens of decoding without them.

Verification is driven by test drafters (an oracle that drafts mlx-lm's own tokens, one
wrong from draft position j, a random one), so acceptance and rollback run on every
path: batching, chunked prefill beside verify rows, prefix hits, preemption, seeded
sampling, stop tokens, logprobs, rows at one position (uniform batching) and sliding
windows. The n-gram drafter runs on the real default model, and the budget is checked
against cost figures like a Mac's and like this CPU's.
"""

import asyncio
import random

import numpy as np
import pytest
from conftest import collect, reference_greedy
from tiny_models import make_tiny_model

from mlx_worker import Engine, EngineConfig, Request, SamplingParams
from mlx_worker.speculative.draft_budget import DraftBudget, expected_tokens
from mlx_worker.speculative.config import SpeculativeConfig
from mlx_worker.speculative.drafters import SuffixLookup
from mlx_worker.speculative.ngram_index import NgramIndex
from mlx_worker.speculative.speculator import MAX_BACKOFF, PROBE_STEPS, Speculator
from mlx_worker.speculative.suffix_counts import SuffixCounts


@pytest.fixture(scope="module")
def model():
    return make_tiny_model("llama")


def prompts(n, lo, hi, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(100, 40000) for _ in range(rng.randrange(lo, hi))] for _ in range(n)]


class Oracle:
    """Drafts the tokens `answers` says follow (mlx-lm's, or an earlier run's); with
    `wrong_from` j, the draft at position j and after are wrong."""

    def __init__(self, answers, wrong_from=None):
        self.answers, self.wrong_from = answers, wrong_from
        self.proposed = []  # lengths of the drafts handed out

    def propose(self, seq, k):
        answer = self.answers[tuple(seq.tokens[: seq.num_prompt])]
        draft = list(answer[len(seq.output_ids) : len(seq.output_ids) + k])
        if self.wrong_from is not None:
            draft = draft[: self.wrong_from] + [(t + 1) % 40000 for t in draft[self.wrong_from :]]
        self.proposed.append(len(draft))
        return draft

    def finished(self, seq):
        pass


class RandomDrafter:
    def __init__(self, seed=0):
        self.rng = random.Random(seed)

    def propose(self, seq, k):
        return [self.rng.randrange(100, 40000) for _ in range(self.rng.randrange(0, k + 1))]

    def finished(self, seq):
        pass


def engine(model, drafter=None, k=4, **kw):
    kw.setdefault("max_total_tokens", 4096)
    spec = {"num_draft_tokens": k, "adaptive": False} if drafter is not None else None
    return Engine(EngineConfig(speculative=spec, **kw), model=model, drafter=drafter)


def run(eng, reqs, stagger=0.0):
    async def one(i, r):
        await asyncio.sleep(stagger * i)
        return await collect(eng, r)

    async def main():
        return await asyncio.gather(*[one(i, r) for i, r in enumerate(reqs)])

    return asyncio.run(main())


def greedy(ps, n, **kw):
    return [Request(rid=f"g{i}", prompt_ids=p, params=SamplingParams(max_tokens=n, ignore_eos=True, temperature=0.0,
                                                                     **kw)) for i, p in enumerate(ps)]


def references(model, ps, n):
    return {tuple(p): reference_greedy(model, p, n) for p in ps}


def check_greedy(model, eng, ps, n, stagger=0.0):
    refs = references(model, ps, n)
    outs = run(eng, greedy(ps, n), stagger)
    for p, (toks, last) in zip(ps, outs):
        assert toks == refs[tuple(p)]
        assert last.finish_reason == "length" and last.num_output_tokens == n
    assert eng.stats()["kv_pages_used"] == 0
    return outs


def test_oracle_drafts_are_all_accepted(model):
    ps = prompts(6, 3, 70, seed=1)
    drafter = Oracle(references(model, ps, 21))
    eng = engine(model, drafter)
    check_greedy(model, eng, ps, 21)
    st = eng.stats()["speculative"]
    # 21 = the first token + 4 x (4 + 1) when every row verifies every step; a row that
    # decodes once (a step while another prompt is prefilled) has no room for a last 4:
    # it decodes, or, when every row of the step is so, the step verifies 3 drafts.
    rows, drafted = st["verify_rows"], st["drafted_tokens"]
    assert st["acceptance_rate"] == 1.0 and st["tokens_per_verify_row"] * rows == pytest.approx(drafted + rows)
    assert 3 * rows <= drafted <= 4 * rows and drafted <= sum(drafter.proposed)
    assert 6 * 3 <= rows <= 6 * 4
    eng.shutdown()


@pytest.mark.parametrize("j", [0, 1, 3])
def test_a_draft_wrong_from_position_j_accepts_j_tokens(model, j):
    ps = prompts(5, 3, 70, seed=2)
    drafter = Oracle(references(model, ps, 17), wrong_from=j)
    eng = engine(model, drafter)
    check_greedy(model, eng, ps, 17)
    st = eng.stats()["speculative"]
    assert st["accepted_tokens"] == sum(min(j, n) for n in drafter.proposed)
    assert st["drafted_tokens"] == sum(drafter.proposed) > st["accepted_tokens"]
    eng.shutdown()


def test_random_drafts_under_churn_chunking_and_uniform_rows(model):
    """Requests arrive while others verify; long prompts are chunked (16 tokens) into the
    same steps as verify rows of random length; a model needing one position per forward."""
    ps = prompts(8, 3, 90, seed=3)
    eng = engine(model, RandomDrafter(), k=6, max_batched_tokens=24)
    check_greedy(model, eng, ps, 15, stagger=0.02)
    assert 0 < eng.stats()["speculative"]["verify_rows"]
    eng.shutdown()
    bigcode = make_tiny_model("gpt_bigcode")
    eng = engine(bigcode, Oracle(references(bigcode, ps[:4], 12), wrong_from=2))
    assert eng.batching == "uniform_offsets"
    check_greedy(bigcode, eng, ps[:4], 12)
    eng.shutdown()


def test_sliding_window_layers_verify_past_the_window():
    gemma = make_tiny_model("gemma3_text")  # window 8
    ps = prompts(3, 20, 40, seed=4)
    eng = engine(gemma, Oracle(references(gemma, ps, 20), wrong_from=3), k=5)
    check_greedy(gemma, eng, ps, 20)
    eng.shutdown()


def test_prefix_hits_and_preemption(model):
    shared = prompts(1, 70, 71, seed=5)[0]
    ps = [shared + [7, 8, 9], shared + [11, 12]]
    eng = engine(model, Oracle(references(model, ps, 10), wrong_from=2))
    check_greedy(model, eng, ps[:1], 10)
    (_, last), = check_greedy(model, eng, ps[1:], 10)
    assert last.num_cached_tokens == 64
    eng.shutdown()
    # 8 pages of 16 tokens; three requests need 3 x 4 pages: someone is preempted.
    ps = prompts(3, 20, 24, seed=6)
    eng = engine(model, Oracle(references(model, ps, 40), wrong_from=3), max_total_tokens=128, page_size=16)
    check_greedy(model, eng, ps, 40)
    assert eng.stats()["preemptions"] > 0
    eng.shutdown()


def sampled(ps, n, **kw):
    return [Request(rid=f"s{i}", prompt_ids=p, params=SamplingParams(
        max_tokens=n, ignore_eos=True, temperature=0.9, top_p=0.95, seed=100 + i, logprobs=True, top_logprobs=3, **kw))
        for i, p in enumerate(ps)]


def streams(eng, reqs):
    """Every output of each request."""
    async def one(r):
        return [o async for o in eng.generate(r)]

    async def main():
        return await asyncio.gather(*[one(r) for r in reqs])

    return asyncio.run(main())


def flat(outs, key):
    return [x for o in outs for x in (getattr(o, key) or [])]


def test_seeded_samples_and_logprobs_are_the_same_with_drafts(model):
    ps = prompts(5, 5, 60, seed=7)
    off = engine(model)
    plain = streams(off, sampled(ps, 18))
    off.shutdown()
    answers = {tuple(p): flat(outs, "token_ids") for p, outs in zip(ps, plain)}
    for drafter in (Oracle(answers), Oracle(answers, wrong_from=1), RandomDrafter(1)):
        eng = engine(model, drafter)
        on = streams(eng, sampled(ps, 18))
        for a, b in zip(on, plain):
            assert flat(a, "token_ids") == flat(b, "token_ids")
            assert len(flat(a, "logprobs")) == 18
            np.testing.assert_allclose(flat(a, "logprobs"), flat(b, "logprobs"), atol=1e-4)
            assert [[t for t, _ in x] for x in flat(a, "top_logprobs")] == \
                [[t for t, _ in x] for x in flat(b, "top_logprobs")]
        assert eng.stats()["speculative"]["verify_rows"] > 0
        eng.shutdown()


def test_a_stop_token_among_accepted_drafts_ends_the_request_there(model):
    ps = prompts(3, 10, 30, seed=8)
    refs = references(model, ps, 30)
    eng = engine(model, Oracle(refs), k=8)
    for p in ps:
        ref = refs[tuple(p)]
        stop = ref[6]  # met inside a verify row's accepted drafts
        (toks, last), = run(eng, [Request(rid="stop", prompt_ids=p, params=SamplingParams(
            max_tokens=30, temperature=0.0, stop_token_ids=[stop]))])
        assert toks == ref[: ref.index(stop) + 1]
        assert last.finish_reason == "stop" and last.stop_reason == stop
        assert last.num_output_tokens == len(toks)
    assert eng.stats()["kv_pages_used"] == 0
    eng.shutdown()


def test_ngram_drafts_on_a_copying_request_of_the_default_model():
    """The real model asked to rewrite a file: looking it up drafts most of it, and the
    answer is the one decoding gives without drafts (method ngram: test_served_speculative)."""
    from mlx_worker.models.loader import load_model

    real, tok = load_model()
    code = ("def add(a, b):\n    return a + b\n\n\ndef mul(a, b):\n    return a * b\n\n\n"
            "def sub(a, b):\n    return a - b\n")
    messages = [{"role": "user", "content": f"Here is my code:\n```python\n{code}```\nRewrite it exactly, in a code block."}]
    prompt = tok.apply_chat_template(messages, add_generation_prompt=True)
    answers = []
    for spec in (None, {"method": "suffix", "adaptive": False}):
        eng = Engine(EngineConfig(speculative=spec, max_total_tokens=1024), model=real, tokenizer=tok)
        req = Request(rid="copy", prompt_ids=prompt, params=SamplingParams(max_tokens=32, temperature=0.0))
        toks, last = run(eng, [req])[0]
        answers.append((toks, last.finish_reason))
        st = eng.stats()["speculative"]
        if spec is not None and spec.get("adaptive") is False:
            assert st["acceptance_rate"] > 0.4 and st["tokens_per_verify_row"] > 1.8, st
        eng.shutdown()
    assert answers[0] == answers[1]
    assert "return a + b" in tok.decode(answers[0][0])


def test_no_drafts_for_rows_with_penalties(model):
    ps = prompts(2, 10, 20, seed=9)
    drafter = Oracle(references(model, ps, 8))
    eng = engine(model, drafter)
    run(eng, greedy(ps, 8, repetition_penalty=1.2))
    run(eng, greedy(ps, 8, presence_penalty=0.5))
    assert drafter.proposed == [] and eng.stats()["speculative"]["verify_rows"] == 0
    eng.shutdown()


@pytest.mark.parametrize("drafter", ["oracle", "wrong_from_1", "random"])
def test_a_recurrent_model_replays_its_accepted_drafts_from_the_state_before(drafter):
    """Qwen3-Next's linear-attention layers take in every draft; a row whose drafts were
    rejected goes back to its state before the verify: tokens stay mlx-lm's, under
    batching, chunked prefill and a prefix hit (a snapshot) on the second round."""
    hybrid = make_tiny_model("qwen3_next")
    shared = prompts(1, 40, 41, seed=10)[0]
    ps = [shared + p for p in prompts(4, 3, 30, seed=9)]
    refs = references(hybrid, ps, 14)
    d = {"oracle": Oracle(refs), "wrong_from_1": Oracle(refs, wrong_from=1), "random": RandomDrafter(2)}[drafter]
    eng = engine(hybrid, d, max_batched_tokens=32)
    check_greedy(hybrid, eng, ps[:1], 14)
    check_greedy(hybrid, eng, ps[1:], 14, stagger=0.02)
    st = eng.stats()
    assert st["speculative"]["verify_rows"] > 0 and st["prefix_hit_tokens"] > 0
    if drafter == "oracle":
        assert st["speculative"]["acceptance_rate"] == 1.0
    else:
        assert st["speculative"]["accepted_tokens"] < st["speculative"]["drafted_tokens"]
    eng.shutdown()


def test_ngram_index_proposes_what_followed_the_latest_earlier_occurrence():
    index = NgramIndex(2, 4)
    tokens = [1, 2, 3, 4, 9, 1, 2, 3, 5, 7, 1, 2, 3]
    assert index.continuation(tokens, 3) == (3, [5, 7, 1])  # not the tail itself, and the latest
    tokens += [5]
    assert index.continuation(tokens, 8) == (4, [7, 1, 2, 3, 5])  # as far as the tokens go
    assert NgramIndex(2, 4).continuation([1, 2, 3], 2) == (0, [])


def test_suffix_counts_draft_the_likeliest_path_while_it_stays_likely():
    tokens = [1, 2, 3, 5, 7, 1, 2, 3, 5, 8, 1, 2, 3, 4, 0, 1, 2, 3]
    counts = SuffixCounts(2, 3)
    counts.extend(tokens)
    score, draft = counts.draft(tokens, 4)
    # 5 followed (1, 2, 3) twice, 4 once (the latest); after (2, 3, 5) come 7 and 8 once each.
    assert draft[:2] == [5, 7] and score == pytest.approx(2 / 3 + 1 / 3 + 1 / 3 + 1 / 3)
    assert counts.draft(tokens, 1) == (pytest.approx(2 / 3), [5])
    rare = SuffixCounts(2, 2)
    rare.extend([1, 2] + [x for t in range(11) for x in (1, 2, 100 + t)] + [1, 2])
    assert rare.draft([1, 2], 3) == (0.0, [])  # no path of probability >= 0.1
    counts.add(tokens, 0, len(tokens), sign=-1)  # taken out again: nothing left
    assert counts.next == {} and counts.draft(tokens, 4) == (0.0, [])


def test_suffix_drafts_from_recent_outputs_and_stops_where_they_ended():
    class Seq:
        def __init__(self, tokens, prompt):
            self.tokens, self.num_prompt, self.draft_index = tokens, prompt, None

        @property
        def output_ids(self):
            return self.tokens[self.num_prompt:]

    lookup = SuffixLookup()
    lookup.keep_outputs = 2
    for i in range(3):
        lookup.finished(Seq([50 + i, 1, 2, 3 + i, 4 + i, 5 + i], 1))
    # After (1, 2): 4 or 5 (p 1/2), then one output's tokens up to its end.
    assert lookup.propose(Seq([9, 9, 1, 2], 4), 8) == [4, 5, 6]
    # Contexts of 2..5 tokens in each output of 6 (its end counted), (1, 2) and (5, 6) in both;
    # the oldest output counted out again.
    assert len(lookup.outputs) == 2 and len(lookup.recent.next) == 2 * (1 + 2 + 3 + 4) - 2


class Row:
    def __init__(self, acceptance):
        self.draft_acceptance = acceptance


def test_the_budget_drafts_where_verifying_is_cheap_and_drafts_are_right():
    mac = np.array([0.010, 0.0002, 0.001, 0.0, 0.00005])  # s per forward, decode row, prefill token, pair unit, verify token
    cpu = np.array([0.003, 0.003, 0.001, 0.0, 0.003])  # a verify token costs a decode row
    budget = DraftBudget(max_k=8)
    good, poor = Row(0.9), Row(0.1)
    assert budget.choose([(good, 500, [1] * 8), (Row(0.8), 500, [1] * 8)], [], [], mac) == (8, [8, 8], False)
    # On a Mac, rows with no draft verify fillers in the drafting rows' forward rather than
    # decode in one of their own; a row that must decode (penalties) keeps that forward.
    assert budget.choose([(good, 500, [1] * 8)], [500] * 6, [], mac) == (8, [8], True)
    assert budget.choose([(good, 500, [1] * 8)], [], [500] * 6, mac) == (0, [0], False)
    k, counts, _ = budget.choose([(good, 500, [1] * 8)], [], [], cpu)
    assert 0 < k < 8 and counts == [k]  # batch 1 on a CPU: a few
    assert budget.choose([(good, 500, [1] * 8), (poor, 500, [1] * 8)], [], [], cpu)[1][1] == 0
    assert budget.choose([(good, 500, [1, 2])], [], [], mac) == (2, [2], False)  # no more than drafted pays
    assert budget.choose([(Row(0.3), 500, [1] * 8)] * 32, [], [], cpu)[0] == 0  # batch 32 on a CPU
    assert budget.choose([(good, 500, [1] * 8)], [], [], None)[0] == 0  # costs not measured yet
    unmeasured = np.array([0.003, 0.003, 0.0003, 0.0, 0.0])  # verify tokens: a prefill token's until measured
    assert budget.choose([(Row(0.3), 500, [1] * 8)] * 32, [], [], unmeasured)[0] > 0
    assert DraftBudget(max_k=4, adaptive=False).choose([(poor, 9, [1, 2]), (poor, 9, [1] * 9)], [], [], None) \
        == (4, [2, 4], False)
    assert expected_tokens(0.5, 2) == 1.75 and expected_tokens(1.0, 3) == 4
    budget.observe(poor, 4, 0)
    assert poor.draft_acceptance < 0.1 and budget.prior < 0.5


class DecodingRow(Row):
    def __init__(self, acceptance, pending):
        super().__init__(acceptance)
        self.matcher, self.num_pending, self.num_scheduled_output = None, pending, 0
        self.params, self.tokens = SamplingParams(max_tokens=10_000), [1, 2, 3]


class Always:
    def propose(self, seq, k):
        return [7] * k


def test_probes_for_drafts_back_off_where_the_budget_refuses_them():
    """A synced step gives up the overlap: at a batch size where the budget keeps refusing
    the drafts found, probes come ever more rarely; where drafts are taken, every step."""
    cpu = np.array([0.003, 0.003, 0.001, 0.0, 0.003])
    mac = np.array([0.010, 0.0002, 0.001, 0.0, 0.00005])

    def synced_steps(rows, coef, steps=1024):
        spec = Speculator(SpeculativeConfig(), drafter=Always())
        synced = 0
        for _ in range(steps):
            sync = spec.wants_sync(rows)  # not synced: every row still has a token on the device
            synced += sync
            spec.plan([(DecodingRow(0.3, pending=not sync), 500) for _ in range(rows)], coef)
        return synced

    probes = synced_steps(32, cpu)
    assert probes <= 1024 // (PROBE_STEPS << MAX_BACKOFF) + MAX_BACKOFF + 1
    assert probes < 1024 // PROBE_STEPS // 2  # not one every PROBE_STEPS
    assert synced_steps(1, mac) == 1024


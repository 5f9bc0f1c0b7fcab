"""The in-graph sampler on synthetic logits: each parameter changes what is sampled."""

from collections import Counter

import mlx.core as mx
import numpy as np
import pytest
from pydantic import ValidationError

from mlx_worker.sampling.sampler import SamplerRow, SamplingParams, sample

PROBS = np.array([0.5, 0.3, 0.15, 0.05], np.float32)
LOGITS = np.log(PROBS)


def draw(n=4000, logits=LOGITS, **kw):
    """n samples of one distribution, one row per (seed, step)."""
    p = SamplingParams(**kw)
    rows = [SamplerRow(p, seed=7, step=i) for i in range(n)]
    toks = sample(mx.array(np.tile(logits, (n, 1))), rows).tokens.tolist()
    c = Counter(toks)
    return np.array([c[i] / n for i in range(len(logits))])


def test_temperature_one_follows_the_distribution():
    assert np.abs(draw() - PROBS).max() < 0.03


def test_low_temperature_concentrates_high_spreads():
    assert draw(temperature=0.1)[0] > 0.95
    hot = draw(temperature=2.0)
    assert hot[3] > 0.09 and hot[0] < 0.4  # flatter than the base distribution


def test_greedy_rows_are_exact_argmax_next_to_sampled_rows():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(6, 1000)).astype(np.float32)
    rows = [SamplerRow(SamplingParams(temperature=0.0 if i % 2 == 0 else 1.0), seed=i, step=0) for i in range(6)]
    toks = sample(mx.array(logits), rows).tokens.tolist()
    for i in range(0, 6, 2):
        assert toks[i] == int(np.argmax(logits[i]))


def test_top_k_keeps_k_best_renormalized():
    f = draw(top_k=2)
    assert f[2] == 0 and f[3] == 0
    assert abs(f[0] - 0.625) < 0.03


def test_top_p_keeps_smallest_set_reaching_p():
    f = draw(top_p=0.6)  # 0.5 < 0.6, so tokens 0 and 1
    assert f[2] == 0 and f[3] == 0 and abs(f[0] - 0.625) < 0.03
    assert draw(top_p=0.4)[0] == 1.0


def test_min_p_drops_tokens_below_fraction_of_best():
    f = draw(min_p=0.2)  # threshold 0.1: token 3 (0.05) goes
    assert f[3] == 0 and f[2] > 0.1


def test_logit_bias():
    assert draw(logit_bias={3: 100.0}, n=200)[3] == 1.0
    assert draw(logit_bias={0: -100.0}, n=500)[0] == 0.0


def test_presence_and_frequency_penalties_use_output_counts():
    counts = mx.array([5.0, 0, 0, 0])
    greedy = dict(temperature=0.0)
    r = SamplerRow(SamplingParams(frequency_penalty=0.5, **greedy), 0, 0, counts=counts)
    assert sample(mx.array(LOGITS[None]), [r]).tokens.tolist() == [1]  # 0 lost 2.5
    r = SamplerRow(SamplingParams(presence_penalty=0.2, **greedy), 0, 0, counts=counts)
    assert sample(mx.array(LOGITS[None]), [r]).tokens.tolist() == [0]  # 0 lost only 0.2
    res = sample(mx.array(LOGITS[None]), [SamplerRow(SamplingParams(frequency_penalty=0.1, **greedy), 0, 0, counts=counts)])
    assert res.counts[0].tolist() == [6.0, 0, 0, 0]  # the sampled token is counted


def test_repetition_penalty_divides_positive_multiplies_negative():
    logits = mx.array([[2.0, 1.5, -1.0]])
    seen = mx.array([True, False, True])
    r = SamplerRow(SamplingParams(temperature=0.0, repetition_penalty=2.0), 0, 0, seen=seen)
    assert sample(logits, [r]).tokens.tolist() == [1]  # 2.0 -> 1.0 < 1.5


def test_logprobs_match_reference_log_softmax():
    rng = np.random.default_rng(1)
    logits = rng.normal(size=(3, 500)).astype(np.float32) * 3
    p = SamplingParams(temperature=0.0, logprobs=True, top_logprobs=5, top_k=3)
    res = sample(mx.array(logits), [SamplerRow(p, 0, 0)] * 3)
    ref = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    toks = res.tokens.tolist()
    np.testing.assert_allclose(res.logprobs.tolist(), ref[np.arange(3), toks], atol=1e-5)
    for i in range(3):
        best = np.argsort(-ref[i])[:5]
        assert res.top_ids[i].tolist() == best.tolist()  # before top_k filtering
        np.testing.assert_allclose(res.top_logprobs[i].tolist(), ref[i][best], atol=1e-5)


def test_seeded_row_is_independent_of_its_batch():
    rng = np.random.default_rng(2)
    logits = rng.normal(size=(1, 2000)).astype(np.float32)
    p = SamplingParams(temperature=1.0)
    alone = sample(mx.array(logits), [SamplerRow(p, seed=42, step=3)]).tokens.tolist()[0]
    others = rng.normal(size=(5, 2000)).astype(np.float32)
    batch = np.concatenate([others[:2], logits, others[2:]])
    rows = [SamplerRow(p, seed=s, step=9) for s in (1, 2)] + [SamplerRow(p, seed=42, step=3)] + [SamplerRow(p, seed=s, step=1) for s in (3, 4, 5)]
    assert sample(mx.array(batch), rows).tokens.tolist()[2] == alone
    diff = {sample(mx.array(logits), [SamplerRow(p, seed=s, step=3)]).tokens.tolist()[0] for s in range(20)}
    assert len(diff) > 5  # other seeds give other tokens


@pytest.mark.parametrize(
    "bad",
    [
        dict(top_p=0.0), dict(top_p=1.5), dict(max_tokens=-1), dict(max_tokens=0), dict(temperature=-0.1),
        dict(top_k=-1), dict(min_p=1.5), dict(n=17), dict(logit_bias={5: 101.0}), dict(stop=[""]),
        dict(min_tokens=5, max_tokens=2), dict(top_logprobs=21), dict(presence_penalty=3.0),
        dict(repetition_penalty=0.0),
    ],
)
def test_bad_values_are_rejected_clearly(bad):
    with pytest.raises(ValidationError) as e:
        SamplingParams(**bad)
    assert str(e.value)


def test_unknown_token_ids_are_rejected():
    with pytest.raises(ValueError, match="outside the vocabulary"):
        SamplingParams(logit_bias={10**6: 1.0}).check_vocab(1000)
    with pytest.raises(ValueError, match="stop_token_ids"):
        SamplingParams(stop_token_ids=[-1]).check_vocab(1000)


def test_gumbel_noise_is_finite_for_every_hash_value():
    from mlx_worker.sampling.sampler import gumbel_noise

    g = gumbel_noise(mx.arange(64, dtype=mx.uint32), mx.arange(64, dtype=mx.uint32), 50000)
    assert bool(mx.all(mx.isfinite(g)).item())


def test_masked_tokens_are_never_sampled():
    rng = np.random.default_rng(3)
    add = np.full(1000, -np.inf, np.float32)
    add[[5, 7]] = 0
    rows = [SamplerRow(SamplingParams(), seed=s, step=t, additive=add) for s in range(20) for t in range(20)]
    toks = sample(mx.array(rng.normal(size=(400, 1000)).astype(np.float32)), rows).tokens.tolist()
    assert set(toks) == {5, 7}


def test_top_p_on_a_large_vocabulary_stays_in_the_exact_nucleus():
    rng = np.random.default_rng(4)
    logits = (rng.normal(size=5000) * 4).astype(np.float32)  # V > candidates
    p = np.exp(logits - logits.max())
    p /= p.sum()
    order = np.argsort(-p)
    nucleus = set(order[: int(np.searchsorted(np.cumsum(p[order]), 0.8)) + 1].tolist())
    rows = [SamplerRow(SamplingParams(top_p=0.8), seed=s, step=0) for s in range(600)]
    toks = sample(mx.array(np.tile(logits, (600, 1))), rows).tokens.tolist()
    assert set(toks) <= nucleus and len(set(toks)) > 1
    top = order[0]
    expect = p[top] / sum(p[i] for i in nucleus)
    assert abs(toks.count(top) / 600 - expect) < 0.06

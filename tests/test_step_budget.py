"""The step budget in time (step_cost.py, step_budget.py): the online fit recovers a
machine's costs, a step with decode rows is sized to the target gap (with a floor), and
a real engine's measured steps are predicted and kept near the gap while prompts arrive,
token-exact with mlx-lm."""

import asyncio
import random

import pytest
from conftest import collect, reference_greedy
from tiny_models import make_tiny_model

from mlx_worker import Engine, EngineConfig, Request, SamplingParams
from mlx_worker.scheduling.step_budget import TOKEN_GAP_FACTOR, StepBudget
from mlx_worker.scheduling.step_cost import PAIRS_UNIT, StepCost, StepShape, shape_of

TRUE = (0.07, 0.009, 0.004, 0.01, 0.006, 0.002)  # seconds per forward, decode row, prefill token, PAIRS_UNIT
# pairs, verify token, image token encoded


def true_time(shape):
    return float(shape.features() @ TRUE)


def fitted(n=80, seed=0):
    rng, cost = random.Random(seed), StepCost()
    tower = random.Random(seed + 1)  # the steps that encode images
    for _ in range(n):
        rows = rng.randrange(0, 33)
        chunks = [(rng.randrange(0, 1500), rng.randrange(1, 512)) for _ in range(rng.randrange(0 if rows else 1, 3))]
        length = rng.randrange(2, 6)
        verify = [(rng.randrange(10, 1500), length) for _ in range(rng.choice([0, 0, 2, 8, 16]))]
        images = tower.choice([0, 0, 0, 64, 256]) if chunks else 0
        shape = shape_of([rng.randrange(10, 1500) for _ in range(rows)], chunks, verify, images)
        cost.observe(shape, true_time(shape) * rng.uniform(0.97, 1.03))
    cost.refit()
    return cost


def test_the_fit_recovers_the_costs_and_never_goes_negative():
    cost = StepCost()
    assert cost.predict(shape_of([100], [])) is None  # nothing measured: no prediction
    cost = fitted()
    assert cost.coef[:4] == pytest.approx(TRUE[:4], rel=0.15)
    assert cost.coef[4] == pytest.approx(TRUE[4], rel=0.25)  # a few verify tokens a step: less to fit on
    assert cost.coef[5] == pytest.approx(TRUE[5], rel=0.15)
    for rows, chunks in (([300] * 16, []), ([], [(0, 2000)]), ([500] * 4, [(0, 64), (128, 200)])):
        shape = shape_of(rows, chunks)
        assert cost.predict(shape) == pytest.approx(true_time(shape), rel=0.05)
    # Collinear steps (always one forward, one row): nothing to tell the parts apart, yet no
    # coefficient comes out negative and the prediction still fits what was seen.
    flat = StepCost()
    for _ in range(10):
        flat.observe(shape_of([50], []), 0.1)
    flat.refit()
    assert (flat.coef >= 0).all() and flat.predict(shape_of([50], [])) == pytest.approx(0.1, rel=0.01)


def test_a_step_with_decode_rows_is_sized_to_the_gap():
    cost = fitted()
    budget = StepBudget(2048, cost=cost, min_prefill_tokens=16)
    room = budget.room(16, 16 * 300)
    decode_only = cost.predict(shape_of([299] * 16, []))
    assert budget.last_gap_s == pytest.approx(TOKEN_GAP_FACTOR * decode_only)
    n = room.prefill(0, 5000)
    assert 16 < n < 2000
    room.take(0, n)
    assert true_time(room.shape) == pytest.approx(budget.last_gap_s, rel=0.08)
    assert room.prefill(0, 5000) == 0  # the step is full
    # The attention of a chunk deep into a long prompt counts: fewer of its tokens fit.
    assert budget.room(16, 16 * 300).prefill(3000, 5000) < n
    # A set gap overrides the factor, and the floor holds however short the gap.
    tight = StepBudget(2048, max_token_gap_s=0.01, min_prefill_tokens=32, cost=cost).room(16, 16 * 300)
    assert tight.prefill(0, 5000) == 32
    # No decode rows (nobody waits for a token): the token budget; with steps in tokens too.
    assert budget.room(0, 0).prefill(0, 5000) == 2048
    assert StepBudget(2048, cost=cost, timed=False).room(16, 4800).prefill(0, 5000) == 2048 - 16
    # Costs not measured yet: small steps, so that they soon are.
    assert StepBudget(2048, min_prefill_tokens=64).room(0, 0).prefill(0, 5000) == 64


def test_a_step_prices_the_vision_tower():
    """The images a step encodes take their time from its gap: the chunk that shows a
    prompt's first images is shorter, and a second prompt's images go through the tower
    in this step only if they fit the gap (the first prompt's always do: images move on)."""
    cost = fitted()
    budget = StepBudget(2048, cost=cost, min_prefill_tokens=16)
    room = budget.room(16, 16 * 300)
    plain = budget.room(16, 16 * 300).prefill(0, 5000)
    assert room.tower_fits(4096)  # the step's first images: however long they take
    n = room.prefill(0, 5000, image_tokens=64)
    filled = shape_of([299] * 16, [(0, n)], image_tokens=64)
    assert n < plain and true_time(filled) == pytest.approx(budget.last_gap_s, rel=0.08)
    room.take(0, 16, image_tokens=64)  # a short chunk: room left for text, and for a few image tokens
    assert room.tower_fits(8) and not room.tower_fits(256)
    assert StepBudget(2048, cost=cost).room(0, 0).tower_fits(4096)  # no decode rows: no gap to keep


def test_a_request_at_risk_of_its_deadline_gets_decode_only_steps():
    """A decoding request that would miss its deadline at the pace of steps carrying
    prefill, but not at decode-only pace, makes steps decode-only until it is done; one
    with time to spare, or one that would miss it anyway, holds no prefill up."""
    from mlx_worker.request import Sequence

    cost = fitted()
    cost.refit()
    budget = StepBudget(2048, min_prefill_tokens=256, cost=cost)

    def row(deadline_in, left):
        seq = Sequence.from_request(Request(rid="r", prompt_ids=list(range(100)),
                                            params=SamplingParams(max_tokens=left)), 16)
        seq.num_computed, seq.deadline = 100, 1000.0 + deadline_in
        return seq

    decode_s = true_time(shape_of([100], []))  # ~0.08 s a decode-only step; ~1.1 s with 256 prompt tokens
    assert budget.at_risk([row(20 * decode_s, 10)], now=1000.0)  # 10 tokens: fits only decode-only
    assert not budget.at_risk([row(1000, 10)], now=1000.0)  # time to spare
    assert not budget.at_risk([row(5 * decode_s, 10)], now=1000.0)  # lost whatever the steps carry
    budget.urgent = True
    assert budget.room(1, 100).prefill(0, 5000) == 0 and budget.room(0, 0).prefill(0, 5000) == 2048
    assert not StepBudget(2048, cost=cost, timed=False).at_risk([row(20 * decode_s, 10)], now=1000.0)


@pytest.fixture(scope="module")
def model():
    return make_tiny_model("llama")


def test_an_engine_keeps_its_steps_near_the_gap_while_prompts_arrive(model):
    """Rows decoding while long prompts arrive, with a gap this fast machine notices (a
    tiny model's decode step is a few ms). The first round teaches the fit what prefill
    costs; in the second, steps with decode rows are cut to the gap instead of carrying
    max_batched_tokens of prefill, and their measured times are predicted by the fit.
    Every request's greedy tokens equal mlx-lm's."""
    rng = random.Random(3)
    eng = Engine(EngineConfig(max_total_tokens=32768, max_batched_tokens=2048, min_prefill_tokens=16,
                              max_token_gap_s=0.01), model=model)
    log = []
    finish = eng._finish_step

    def record(step):
        t0 = max(eng._last_finish, step.launched_at)
        finish(step)
        shape = shape_of([p for _, p in step.plan.decode], [(c.start, c.length) for c in step.plan.prefills])
        log.append((eng._last_finish - t0, shape, eng.budget.cost.predict(shape)))

    eng._finish_step = record

    def request(rid, ids, n):
        return Request(rid=rid, prompt_ids=ids, params=SamplingParams(max_tokens=n, ignore_eos=True, temperature=0.0))

    async def round_(tag, short, long):
        rows = [asyncio.create_task(collect(eng, request(f"{tag}s{i}", p, 60))) for i, p in enumerate(short)]
        while not all(eng.scheduler.by_rid.get(f"{tag}s{i}") and eng.scheduler.by_rid[f"{tag}s{i}"].next_input is not None
                      for i in range(len(short))):
            await asyncio.sleep(0.002)  # every short prompt is decoding
        late = [asyncio.create_task(collect(eng, request(f"{tag}l{i}", p, 4))) for i, p in enumerate(long)]
        return await asyncio.gather(*rows, *late)

    for tag in ("learn", "cut"):
        short = [[rng.randrange(100, 40000) for _ in range(20)] for _ in range(4)]
        long = [[rng.randrange(100, 40000) for _ in range(900)] for _ in range(3)]
        start = len(log)
        outs = asyncio.run(round_(tag, short, long))
    for p, (toks, _) in zip(short + long, outs):
        assert toks == reference_greedy(model, p, 60 if len(p) == 20 else 4)
    mixed = [(t, s, pred) for t, s, pred in log[start:] if s.decode_rows and s.prefill_tokens]
    chunks = sorted(s.prefill_tokens for _, s, _ in mixed)
    assert len(chunks) >= 4 and chunks[len(chunks) // 2] < 1024, chunks  # cut, not the token budget
    st = eng.stats()
    assert st["token_gap_target_s"] > 0 and st["prefill_tokens_per_step_p50"] > 0 and st["step_s_p99"] >= st["step_s_p50"]
    errors = sorted(abs(pred - t) / t for t, _, pred in mixed if pred)
    print(f"{len(mixed)} mixed steps, chunks {chunks}, prediction error p50 {errors[len(errors) // 2]:.2f}; "
          f"{st['step_cost']}")
    assert errors[len(errors) // 2] < 0.75  # steps of a few ms on 2 shared cores: a broken fit is off by far more
    eng.shutdown()


def test_pairs_unit_keeps_features_of_one_scale():
    shape = StepShape()
    shape.add_prefill(0, 1024)
    assert shape.features()[3] == pytest.approx(1024 * 1025 / 2 / PAIRS_UNIT)

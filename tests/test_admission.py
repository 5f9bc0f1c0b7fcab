"""Admission that keeps its promises (admission.py): the prediction from measured steps,
refusals with when to retry, and a real engine that refuses what it cannot finish in time
while it serves what it took in full."""

import asyncio
import random
import time

import pytest
from conftest import collect, reference_greedy
from tiny_models import make_tiny_model

from mlx_worker import Engine, EngineConfig, Request, RequestOutput, SamplingParams
from mlx_worker.scheduling.admission import MIN_OUTPUTS, PRIOR_CALIBRATION, SAFETY, Admission, Promise
from mlx_worker.memory.page_manager import PageManager
from mlx_worker.request import Sequence
from mlx_worker.scheduling.scheduler import Scheduler


@pytest.fixture(scope="module")
def model():
    return make_tiny_model("llama")


def prompt(n, seed):
    rng = random.Random(seed)
    return [rng.randrange(100, 40000) for _ in range(n)]


def seq(rid, n, seed, max_tokens=4, timeout_s=None):
    req = Request(rid=rid, prompt_ids=prompt(n, seed), params=SamplingParams(max_tokens=max_tokens), timeout_s=timeout_s)
    return Sequence.from_request(req, 16)


def busy(sched):
    """A request decoding ahead of the waiting ones (its prompt adds nothing to their wait):
    a request alone is never withdrawn."""
    decoding = seq("decoding", 10, 2)
    decoding.next_input = 0
    sched.running.append(decoding)


def measured(admission):
    admission.observe(0.5, 0, 4)  # decode only: the gap between tokens
    admission.observe(1.0, 1000, 0)  # prefill only: a rate no waiting request can count on once...
    assert admission.seconds_per_token == pytest.approx(0.001) and admission.gap_s == pytest.approx(0.5)
    admission.observe(2.0, 200, 4)  # ...200 prompt tokens beside 4 decode rows in 2 s is seen: 0.01 s a token
    admission.observe(0.5, 0, 4)
    return admission


def test_the_prediction_is_the_work_ahead_at_the_measured_rates():
    sched = Scheduler(PageManager(256, 16), set(), max_running=8, max_batched_tokens=512)
    admission = measured(Admission(request_timeout_s=100))
    assert admission.seconds_per_token == pytest.approx(0.01)
    gap = admission.gap_s
    assert 0.5 < gap < 2.0  # decayed over the steps with decode rows
    for i in range(3):
        assert sched.add(seq(f"w{i}", 300, 3 + i)) is None  # 900 prompt tokens queued
    new = seq("new", 100, 7, max_tokens=50)
    # Nothing finished yet: the output is predicted as its max_tokens.
    assert admission.predict(new, sched) == pytest.approx((900 + 100) * 0.01 + 50 * gap)
    for n in [10] * MIN_OUTPUTS:  # recent requests stopped after 10 tokens
        admission.finished(RequestOutput(rid="done", token_ids=[], finished=True, finish_reason="stop",
                                         num_output_tokens=n))
    assert admission.output_tokens(50) == 10 and admission.output_tokens(4) == 4
    assert admission.predict(new, sched) == pytest.approx(10.0 + 10 * gap)


def test_what_cannot_finish_in_its_timeout_is_refused_with_when_to_retry():
    sched = Scheduler(PageManager(512, 16), set(), max_running=8, max_batched_tokens=512)
    admission = Admission(request_timeout_s=10)
    assert admission.refuse(seq("alone", 3000, 2), sched) is None  # nothing ahead: always taken
    assert sched.add(seq("first", 3000, 2)) is None
    # Not measured yet: taken with nothing ahead...
    out = admission.refuse(seq("early", 10, 1), sched)
    assert out.error_code == "overloaded" and out.retry_after_s > 0 and "measured" in out.error
    fresh = Scheduler(PageManager(512, 16), set(), max_running=8, max_batched_tokens=512)
    for i in range(4):  # ...or while the prompts ahead fit one step's budget: a burst of short ones
        assert admission.refuse(seq(f"short{i}", 100, 20 + i), fresh) is None and fresh.add(seq(f"short{i}", 100, 20 + i)) is None
    assert admission.refuse(seq("fifth", 200, 30), fresh).error_code == "overloaded"  # 600 > 512
    measured(admission)
    out = admission.refuse(seq("late", 10, 8), sched)  # 30 s of prefill ahead: past 8 s
    assert out.finished and out.finish_reason == "error" and out.error_code == "overloaded"
    predicted = admission.calibration * admission.predict(seq("late", 10, 8), sched)  # the prior: no completions yet
    assert out.retry_after_s == pytest.approx(predicted - SAFETY * 10)
    assert "overloaded" in out.error and f"{predicted:.0f} s" in out.error
    # The client's own timeout counts over the server's default.
    assert admission.refuse(seq("patient", 10, 8, timeout_s=100), sched) is None
    assert admission.num_refused == 3
    assert Admission(request_timeout_s=None).refuse(seq("any", 10, 9), sched) is None


def test_predictions_are_scaled_by_what_recent_completions_took_of_them():
    sched = Scheduler(PageManager(512, 16), set(), max_running=8, max_batched_tokens=512)
    admission = measured(Admission(request_timeout_s=1000))
    assert admission.calibration == PRIOR_CALIBRATION  # no completions seen yet
    sched.add(seq("ahead", 100, 1))
    model = admission.predict(seq("x", 100, 2, timeout_s=100), sched)
    for i in range(8):  # completions that took three times what the model said
        admission._admitted[f"done{i}"] = Promise(time.perf_counter() - 3.0, 1.0, 1.0, 1000)
        admission.finished(RequestOutput(rid=f"done{i}", token_ids=[], finished=True, finish_reason="length",
                                         num_output_tokens=4))
    assert admission.calibration == pytest.approx(3.0, rel=0.01)
    assert admission.refuse(seq("x", 100, 2, timeout_s=2.5 * model / SAFETY), sched) is not None
    assert admission.refuse(seq("y", 100, 3, timeout_s=3.5 * model / SAFETY), sched) is None


def test_a_full_batch_adds_the_wait_for_a_slot():
    sched = Scheduler(PageManager(512, 16), set(), max_running=2, max_batched_tokens=512)
    admission = measured(Admission(request_timeout_s=1000))
    for i, n in enumerate((40, 8)):
        s = seq(f"r{i}", 16, i, max_tokens=n)
        sched.add(s)
    sched.schedule()  # both prefill and run: the batch is full
    assert len(sched.running) == 2 and not sched.waiting
    new = seq("new", 16, 9, max_tokens=1)
    # The shorter running request frees its slot after its 8 tokens (one is scheduled).
    assert admission.predict(new, sched) == pytest.approx((8 - 1) * admission.gap_s + admission.gap_s)


def test_a_request_that_would_make_an_admitted_one_late_is_refused():
    """A promise holds against later arrivals: a request whose prefill would push one
    already admitted past its deadline is refused, though it would itself fit its own
    (patient) timeout; a short one that leaves the promise standing is taken, and once
    the admitted one ends, the long one is taken too."""
    sched = Scheduler(PageManager(1024, 16), set(), max_running=8, max_batched_tokens=512)
    admission = measured(Admission())
    a = seq("a", 100, 1, timeout_s=10)  # alone: taken; predicted ~7 s of its 8 (0.8 x 10)
    assert admission.refuse(a, sched) is None and sched.add(a) is None
    long = seq("long", 300, 2, timeout_s=1000)  # 3 s of prefill ahead of a's tokens: a would miss
    out = admission.refuse(long, sched)
    assert out.error_code == "overloaded" and "already took" in out.error and out.retry_after_s >= 1
    short = seq("short", 10, 3, timeout_s=100)
    assert admission.refuse(short, sched) is None and sched.add(short) is None
    admission.finished(RequestOutput(rid="a", token_ids=[], finished=True, finish_reason="stop", num_output_tokens=4))
    assert admission.refuse(seq("long", 300, 2, timeout_s=1000), sched) is None
    assert admission.num_refused == 1


def test_a_taken_request_that_can_no_longer_finish_is_withdrawn_before_any_work():
    """A prediction gone wrong after admission: the request queued behind more prefill
    than its deadline leaves room for, and not yet started, is refused (overloaded, with
    a Retry-After) and leaves the queue; one that still fits, or one already started,
    stays."""
    sched = Scheduler(PageManager(1024, 16), set(), max_running=8, max_batched_tokens=512)
    admission = measured(Admission())
    now = time.perf_counter()
    first, second, third = (seq(r, 300, i, timeout_s=100) for i, r in enumerate(["first", "second", "third"]))
    for s in (first, second, third):
        assert sched.add(s) is None
    scale, gap = admission.calibration, admission.gap_s
    ends = [now + scale * (300 * (i + 1) * 0.01 + 4 * gap) for i in range(3)]
    first.deadline, second.deadline, third.deadline = ends[0] + 60, ends[1] + 60, ends[2] - 1
    assert admission.withdraw(sched) and sched.waiting == [first, second]  # the third: past its deadline
    started = sched.waiting[1]
    started.deadline = now  # past due, but already started: its work is spent, it is not withdrawn
    started.num_preemptions = 1
    assert admission.withdraw(sched) == [] and len(sched.waiting) == 2
    assert admission.num_withdrawn == 1
    alone = Scheduler(PageManager(1024, 16), set(), max_running=8, max_batched_tokens=512)
    hurried = seq("hurried", 300, 7, timeout_s=0.1)
    assert alone.add(hurried) is None
    hurried.deadline = now  # it cannot make it, but nothing is ahead of it: kept, as admission took it
    assert admission.withdraw(alone) == [] and alone.waiting == [hurried]


def waiting_behind_work(rid, n, timeout_s):
    """A measured admission, and a scheduler with one request waiting behind a decoding one."""
    sched = Scheduler(PageManager(1024, 16), set(), max_running=8, max_batched_tokens=512)
    waiting = seq(rid, n, 1, timeout_s=timeout_s)
    assert sched.add(waiting) is None
    busy(sched)
    return measured(Admission()), sched, waiting


def test_a_withdrawal_leaves_the_answer_time_to_reach_its_client():
    admission, sched, s = waiting_behind_work("s", 300, timeout_s=100)
    s.deadline = time.perf_counter() + admission.calibration * (300 * 0.01 + 4 * admission.gap_s) + 2
    assert admission.withdraw(sched) == []  # its last token is predicted 2 s before the deadline...
    s.return_s = 5  # ...but its answer needs 5 s more to reach the client
    assert [out.rid for out in admission.withdraw(sched)] == ["s"]


def test_a_withdrawal_is_a_refusal_with_when_to_retry():
    admission, sched, late = waiting_behind_work("late", 500, timeout_s=10)
    late.deadline = time.perf_counter() + 1  # 5 s of prefill alone: it cannot make it
    [out] = admission.withdraw(sched)
    assert out.rid == "late" and out.finished and out.finish_reason == "error" and out.error_code == "overloaded"
    assert "10 s timeout" in out.error and out.retry_after_s >= 1 and not sched.waiting and "late" not in sched.by_rid


def test_an_engine_refuses_what_it_cannot_finish_and_serves_what_it_took(model):
    """Once steps are measured, long prompts with a patient client are taken, prefilled 8
    tokens a step; a request arriving while they run would finish long after its 50 ms:
    refused as an error output, with when to retry, and the others are served in full
    and token-exact."""
    eng = Engine(EngineConfig(max_total_tokens=8192, max_batched_tokens=8, request_timeout_s=0.05), model=model)
    ps = [prompt(600, 3 + i) for i in range(3)]

    def request(rid, ids, n, timeout_s=None):
        return Request(rid=rid, prompt_ids=ids, timeout_s=timeout_s,
                       params=SamplingParams(max_tokens=n, ignore_eos=True, temperature=0.0))

    async def main():
        await collect(eng, request("warm", prompt(20, 1), 3))  # steps with prefill and decode rows measured
        taken = [asyncio.create_task(collect(eng, request(f"long{i}", p, 6, timeout_s=600))) for i, p in enumerate(ps)]
        while eng.stats()["steps"] < 8:
            await asyncio.sleep(0.001)
        refused = await collect(eng, request("late", prompt(20, 9), 4))
        assert eng.stats()["queued_prefill_tokens"] > 0  # it was refused with prompts still queued
        return [t for t, _ in await asyncio.gather(*taken)], refused

    toks, (refused_toks, last) = asyncio.run(main())
    for p, t in zip(ps, toks):
        assert t == reference_greedy(model, p, 6)
    assert refused_toks == [] and last.error_code == "overloaded" and last.retry_after_s > 0
    st = eng.stats()
    assert st["refused_overloaded"] == 1 and st["queue_wait_s"] == 0 and st["kv_pages_used"] == 0
    assert st["tokens_wasted"] == 0 and st["tokens_computed"] >= 3 * 600
    assert st["late"] == {"queued": 0, "prefill": 0, "decode": 0}  # what it took ended in time

    async def samples():  # n=2: each sample is a request of its own, with the client's timeout
        params = SamplingParams(max_tokens=3, ignore_eos=True, temperature=0.0, n=2)
        return [out async for out in eng.generate(Request(rid="two", prompt_ids=prompt(200, 11), params=params,
                                                          timeout_s=600))]

    outs = asyncio.run(samples())
    assert all(o.finish_reason != "error" for o in outs) and sum(len(o.token_ids) for o in outs) == 6
    eng.shutdown()


def test_requests_that_end_past_their_deadlines_are_counted_by_phase(model):
    """A request with nothing ahead is always taken, even with a timeout nobody could meet;
    ending past its deadline, it is counted late by where it stood then (decoding)."""
    eng = Engine(EngineConfig(max_total_tokens=4096, max_batched_tokens=64), model=model)

    def request(rid, timeout_s):
        return Request(rid=rid, prompt_ids=prompt(100, 5), timeout_s=timeout_s,
                       params=SamplingParams(max_tokens=8, ignore_eos=True, temperature=0.0))

    hurried, _ = asyncio.run(collect(eng, request("hurried", 1e-3)))
    patient, _ = asyncio.run(collect(eng, request("patient", 600)))
    assert len(hurried) == len(patient) == 8
    assert eng.stats()["late"] == {"queued": 0, "prefill": 0, "decode": 1}
    eng.shutdown()


def test_the_prediction_holds_against_measured_completions(model):
    """Requests arriving over time on a real engine: each admitted one's completion,
    divided by the prediction it was admitted on, is near or below 1 (the prediction is
    meant to be safe, not wildly pessimistic)."""
    eng = Engine(EngineConfig(max_total_tokens=16384, max_batched_tokens=64, request_timeout_s=600), model=model)

    async def main():
        async def one(i):
            await asyncio.sleep(0.05 * i)
            req = Request(rid=f"r{i}", prompt_ids=prompt(60 + 37 * (i % 5), i),
                          params=SamplingParams(max_tokens=12, ignore_eos=True))
            return await collect(eng, req)

        return await asyncio.gather(*[one(i) for i in range(40)])

    outs = asyncio.run(main())
    assert all(len(t) == 12 for t, _ in outs)
    accuracy = sorted(eng.admission.accuracy)
    assert len(accuracy) >= 20
    p50, p90 = accuracy[len(accuracy) // 2], accuracy[int(0.9 * len(accuracy))]
    print(f"completion / prediction: p50 {p50:.2f} p90 {p90:.2f} over {len(accuracy)} requests")
    assert 0.2 < p50 < 1.3 and p90 < 2.0
    eng.shutdown()


def test_the_estimate_counts_only_what_the_prefix_cache_does_not_hold(model):
    eng = Engine(EngineConfig(max_total_tokens=4096), model=model)
    p = prompt(160, 1)
    asyncio.run(collect(eng, Request(rid="a", prompt_ids=p, params=SamplingParams(max_tokens=2))))
    again = Sequence.from_request(Request(rid="b", prompt_ids=p + [7, 8], params=SamplingParams()), 16)
    assert eng.scheduler.uncached_tokens(again) == 162 - 160  # ten whole pages are cached
    fresh = Sequence.from_request(Request(rid="c", prompt_ids=prompt(162, 2), params=SamplingParams()), 16)
    assert eng.scheduler.uncached_tokens(fresh) == 162
    eng.shutdown()

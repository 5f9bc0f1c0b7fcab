"""Admission by queued work (admission.py): the estimate, and refusals on a real engine."""

import asyncio
import random

import pytest
from conftest import collect, reference_greedy
from tiny_models import make_tiny_model

from mlx_worker import Engine, EngineConfig, Request, SamplingParams
from mlx_worker.admission import Admission
from mlx_worker.page_manager import PageManager
from mlx_worker.request import Sequence
from mlx_worker.scheduler import Scheduler


@pytest.fixture(scope="module")
def model():
    return make_tiny_model("llama")


def prompt(n, seed):
    rng = random.Random(seed)
    return [rng.randrange(100, 40000) for _ in range(n)]


def seq(rid, n, seed):
    return Sequence.from_request(Request(rid=rid, prompt_ids=prompt(n, seed), params=SamplingParams(max_tokens=4)), 16)


def test_a_request_that_would_wait_past_the_limit_is_refused_with_when_to_retry():
    sched = Scheduler(PageManager(256, 16), set(), max_running=8, max_batched_tokens=512)
    admission = Admission(max_queue_wait_s=10)
    assert admission.refuse(seq("early", 3000, 1), sched) is None  # nothing measured yet: admitted
    admission.observe(2.0, 200)  # a step: 200 prompt tokens in 2 s, 0.01 s a token
    admission.observe(0.5, 0)  # a decode-only step tells nothing about prefill
    assert admission.seconds_per_token == pytest.approx(0.01)
    assert admission.refuse(seq("alone", 3000, 2), sched) is None  # 30 s of its own, but nothing ahead
    for i in range(3):
        assert sched.add(seq(f"w{i}", 300, 3 + i)) is None  # 900 prompt tokens queued: 9 s
    assert admission.refuse(seq("fits", 50, 6), sched) is None
    assert sched.add(seq("fits", 200, 7)) is None  # 1,100 tokens: 11 s
    out = admission.refuse(seq("late", 10, 8), sched)
    assert out.finished and out.finish_reason == "error" and out.error_code == "overloaded"
    assert out.retry_after_s == pytest.approx(1.0) and "11 s behind 1100 queued prompt tokens" in out.error
    assert admission.num_refused == 1
    assert Admission(max_queue_wait_s=None).refuse(seq("any", 10, 9), sched) is None


def test_the_estimate_counts_only_what_the_prefix_cache_does_not_hold(model):
    eng = Engine(EngineConfig(max_total_tokens=4096), model=model)
    p = prompt(160, 1)
    asyncio.run(collect(eng, Request(rid="a", prompt_ids=p, params=SamplingParams(max_tokens=2))))
    again = Sequence.from_request(Request(rid="b", prompt_ids=p + [7, 8], params=SamplingParams()), 16)
    assert eng.scheduler.uncached_tokens(again) == 162 - 160  # ten whole pages are cached
    fresh = Sequence.from_request(Request(rid="c", prompt_ids=prompt(162, 2), params=SamplingParams()), 16)
    assert eng.scheduler.uncached_tokens(fresh) == 162
    eng.shutdown()


def test_an_engine_over_its_queue_wait_refuses_and_goes_on_serving(model):
    """With a limit no queue meets: long prompts taken before anything was measured are
    still in prefill (8 tokens a step) when a request arrives; it is refused, as an
    error output, and the others are served in full."""
    eng = Engine(EngineConfig(max_total_tokens=8192, max_batched_tokens=8, max_queue_wait_s=1e-9), model=model)
    ps = [prompt(600, 3 + i) for i in range(3)]

    def request(rid, ids, n):
        return Request(rid=rid, prompt_ids=ids, params=SamplingParams(max_tokens=n, ignore_eos=True, temperature=0.0))

    async def main():
        taken = [asyncio.create_task(collect(eng, request(f"long{i}", p, 6))) for i, p in enumerate(ps)]
        while eng.stats()["steps"] < 2:  # a step with prefill has been measured
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
    eng.shutdown()

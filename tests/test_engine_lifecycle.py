"""Abort, cancellation, pool accounting and eviction on a running engine."""

import asyncio
import random
import time

import pytest
from conftest import collect, reference_greedy, run_requests
from tiny_models import make_tiny_model

from mlx_worker import Engine, EngineConfig, Request, SamplingParams


@pytest.fixture(scope="module")
def model():
    return make_tiny_model("llama")


def rand_prompt(n, seed):
    rng = random.Random(seed)
    return [rng.randrange(100, 40000) for _ in range(n)]


def req(rid, prompt, max_tokens, **kw):
    return Request(rid=rid, prompt_ids=prompt, params=SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0, **kw))


def test_abort_frees_pages_and_ends_the_stream(model):
    eng = Engine(EngineConfig(max_total_tokens=2048), model=model)

    async def main():
        agen = eng.generate(req("long", rand_prompt(40, 1), 10_000))
        got = 0
        async for out in agen:
            got += len(out.token_ids)
            if got == 5:
                eng.abort("long")
            if out.finished:
                return out, got

    last, got = asyncio.run(main())
    assert last.finish_reason == "abort" and got < 100
    st = eng.stats()
    assert st["running"] == 0 and st["kv_pages_used"] == 0
    eng.shutdown()


def test_cancelled_consumer_aborts_request(model):
    eng = Engine(EngineConfig(max_total_tokens=2048), model=model)

    async def main():
        async def consume():
            async for _ in eng.generate(req("c", rand_prompt(30, 2), 10_000)):
                pass

        task = asyncio.create_task(consume())
        while eng.stats()["running"] == 0:
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        for _ in range(200):
            st = eng.stats()
            if st["running"] == 0 and st["kv_pages_used"] == 0:
                return st
            await asyncio.sleep(0.01)
        return st

    st = asyncio.run(main())
    assert st["running"] == 0 and st["kv_pages_used"] == 0
    eng.shutdown()


def test_every_page_free_or_cached_after_mixed_finish_and_abort(model):
    eng = Engine(EngineConfig(max_total_tokens=1024), model=model)

    async def main():
        tasks = [asyncio.create_task(collect(eng, req(f"f{i}", rand_prompt(17 + i * 9, i), 6 + i))) for i in range(6)]
        agen = eng.generate(req("x", rand_prompt(50, 99), 10_000))
        async for out in agen:
            if out.num_output_tokens >= 3:
                break
        await agen.aclose()
        return await asyncio.gather(*tasks)

    asyncio.run(main())
    time.sleep(0.2)
    st = eng.stats()
    pm = eng.pages
    assert st["kv_pages_used"] == 0
    assert all(r == 0 for r in pm.refs)
    assert len(pm.free) + len(pm.lru) == pm.num_pages
    assert set(pm.lru) == set(pm.hash_of)
    eng.shutdown()


def test_eviction_under_pressure_keeps_outputs_correct(model):
    eng = Engine(EngineConfig(max_total_tokens=160, page_size=16), model=model)  # 10 pages
    for seed in range(4):
        p = rand_prompt(60, 10 + seed)
        (toks, _), = run_requests(eng, [p], 8)
        assert toks == reference_greedy(model, p, 8)
    st = eng.stats()
    assert st["evictions"] > 0 and st["kv_pages_used"] == 0
    eng.shutdown()


def test_prompt_larger_than_pool_is_an_error_not_a_crash(model):
    eng = Engine(EngineConfig(max_total_tokens=64), model=model)
    (toks, last), = run_requests(eng, [rand_prompt(100, 3)], 4)
    assert toks == [] and last.finish_reason == "error" and "exceeds" in last.error
    (toks, last), = run_requests(eng, [rand_prompt(10, 4)], 4)  # still serving
    assert len(toks) == 4
    eng.shutdown()


def test_eos_stops_and_stop_token_ids(model):
    p = rand_prompt(20, 5)
    ref = reference_greedy(model, p, 12)
    eng = Engine(EngineConfig(max_total_tokens=1024), model=model)
    toks, last = asyncio.run(collect(eng, req("s", p, 12, stop_token_ids=[ref[4]])))
    k = ref.index(ref[4])
    assert toks == ref[: k + 1] and last.finish_reason == "stop"
    assert eng.stats()["kv_pages_used"] == 0
    eng.shutdown()


def test_engine_never_blocks_the_event_loop(model):
    eng = Engine(EngineConfig(max_total_tokens=4096), model=model)

    async def main():
        gaps, stop = [], False

        async def ticker():
            t = time.perf_counter()
            while not stop:
                await asyncio.sleep(0.005)
                now = time.perf_counter()
                gaps.append(now - t)
                t = now

        tick = asyncio.create_task(ticker())
        await asyncio.gather(*[collect(eng, req(f"b{i}", rand_prompt(200, i), 30)) for i in range(8)])
        stop = True
        await tick
        return gaps

    gaps = asyncio.run(main())
    assert len(gaps) > 10 and max(gaps) < 0.25
    eng.shutdown()


def test_an_idle_engine_burns_no_cpu(model):
    """Nothing spins once the last request ends (OpenBLAS's workers spin ~0.1 s by
    default: on a shared machine that core is taken from Serve's proxy and ingress)."""
    import resource

    eng = Engine(EngineConfig(max_total_tokens=2048), model=model)
    try:
        run_requests(eng, [rand_prompt(64, 3)], 16)
        before = resource.getrusage(resource.RUSAGE_SELF)
        time.sleep(0.3)
        after = resource.getrusage(resource.RUSAGE_SELF)
        cpu = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
        assert cpu < 0.03, f"{cpu * 1e3:.0f} ms of CPU in 0.3 s idle"
    finally:
        eng.shutdown()


def test_host_work_is_reported_in_wall_and_cpu_time(model):
    """The engine thread's host work per step, in wall time and in its own CPU time (the
    wall time less the waits for a core that the forward holds on a CPU device)."""
    eng = Engine(EngineConfig(max_total_tokens=2048), model=model)
    try:
        run_requests(eng, [rand_prompt(64, s) for s in range(4)], 16)
        st = eng.stats()
    finally:
        eng.shutdown()
    slack = 0.01  # ms: the two clocks are read a few hundred ns apart
    assert 0 < st["graph_build_cpu_ms_per_step"] <= st["graph_build_ms_per_step"] + slack
    assert st["graph_build_cpu_ms_per_step"] < st["host_cpu_ms_per_step"] <= st["host_ms_per_step"] + slack


def test_steps_leave_no_reference_cycles(model):
    """A step's objects are freed when it ends, not when Python's cycle collector next
    runs: a cycle through a forward's caches held the staged decode KV (GBs under load)."""
    import gc

    import mlx.core as mx

    eng = Engine(EngineConfig(max_total_tokens=2048), model=model)
    try:
        run_requests(eng, [rand_prompt(20, 0)], 4)  # warm: one-time objects
        gc.collect()
        gc.disable()
        try:
            run_requests(eng, [rand_prompt(n, n) for n in (30, 47, 64)], 12)  # ragged: staged decode
            gc.set_debug(gc.DEBUG_SAVEALL)
            gc.collect()
            ours = [o for o in gc.garbage if isinstance(o, mx.array)
                    or getattr(type(o), "__module__", "").startswith("mlx_worker")
                    or getattr(o, "__module__", None) and o.__module__.startswith("mlx_worker")]
        finally:
            gc.set_debug(0)
            gc.garbage.clear()
            gc.enable()
    finally:
        eng.shutdown()
    assert not ours, sorted({type(o).__name__ if not callable(o) else o.__qualname__ for o in ours})


def test_shutdown_returns_once_the_engine_thread_is_gone(model):
    """Its C++ thread-local destructors (MLX's compile cache) take the GIL after join();
    an interpreter that exits before they ran aborts the process."""
    import ctypes
    import os

    if not os.path.isdir("/proc/self/task"):
        pytest.skip("needs Linux's /proc to see OS threads")
    access = ctypes.PyDLL(None).access  # PyDLL keeps the GIL: the thread can't finish meanwhile
    eng = Engine(EngineConfig(max_total_tokens=1024), model=model)
    run_requests(eng, [rand_prompt(20, 4)], 4)
    task = f"/proc/self/task/{eng._thread.native_id}".encode()
    eng.shutdown()
    assert access(task, 0) != 0, "the engine's OS thread outlived shutdown()"


def test_a_script_that_never_calls_shutdown_exits_cleanly():
    """The interpreter's finalization must not meet a live engine thread (exit 134)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    script = (
        "import asyncio\n"
        "from tiny_models import make_tiny_model\n"
        "from mlx_worker import Engine, EngineConfig, Request, SamplingParams\n"
        "engine = Engine(EngineConfig(max_total_tokens=1024), model=make_tiny_model('llama'))\n"
        "async def main():\n"
        "    async for _ in engine.generate(Request(rid='a', prompt_ids=[5, 6, 7], params=SamplingParams(max_tokens=8))):\n"
        "        pass\n"
        "asyncio.run(main())\n"
        "print('done')\n"
    )
    tests = Path(__file__).parent
    for _ in range(3):  # the abort it guards against is a race: give it three chances
        r = subprocess.run([sys.executable, "-c", script], cwd=tests.parent, capture_output=True, text=True,
                           timeout=120, env={**os.environ, "PYTHONPATH": f"{tests}:{tests.parent}"})
        assert r.returncode == 0 and r.stdout.strip() == "done", r.stderr[-2000:]


def test_a_failing_step_fails_its_requests_and_the_engine_serves_on():
    """gpt_bigcode's forward takes one integer offset for the batch (np.arange over it), so
    with the load-time probe overridden (batching="ragged") a decode step of two rows at
    different positions raises inside the model: those two requests end with an engine
    error, their pages are freed, and the next request runs."""
    model = make_tiny_model("gpt_bigcode")
    eng = Engine(EngineConfig(max_total_tokens=2048, batching="ragged"), model=model)

    async def main():
        both = await asyncio.gather(collect(eng, req("a", rand_prompt(20, 1), 8)),
                                    collect(eng, req("b", rand_prompt(37, 2), 8)))
        alone = await collect(eng, req("c", rand_prompt(25, 3), 8))
        return both, alone

    both, (toks, last) = asyncio.run(main())
    for _, out in both:
        assert out.finish_reason == "error" and out.error_code == "engine_error" and "failed" in out.error
    # A consumer that falls behind still gets the tokens before the error, never one item
    # that carries both (a streamed response must start before it can report the failure).

    async def slow():
        items = []
        streams = [eng.generate(req(r, rand_prompt(n, seed), 8)) for r, n, seed in (("d", 20, 1), ("e", 37, 2))]
        firsts = [asyncio.ensure_future(s.__anext__()) for s in streams]
        await asyncio.sleep(1.0)  # both steps (prefill, failing decode) are done by now
        for s, first in zip(streams, firsts):
            items.append([await first] + [out async for out in s])
        return items

    for outs in asyncio.run(slow()):
        assert outs[0].token_ids and outs[0].finish_reason is None
        assert outs[-1].finish_reason == "error" and not outs[-1].token_ids
    assert toks == reference_greedy(model, rand_prompt(25, 3), 8) and last.finish_reason == "length"
    st = eng.stats()
    assert st["failed_steps"] >= 1 and st["kv_pages_used"] == 0 and st["running"] == 0
    assert eng.error is None
    eng.shutdown()


@pytest.mark.parametrize("overlap", [False, True])
def test_a_step_that_fails_when_its_results_are_read_fails_its_requests(overlap):
    """A step can also fail when its results are read (the device's error surfaces at
    the wait, not at the launch): its requests end with an engine error, not left
    running on a step that never finished, and the engine serves on."""
    model = make_tiny_model("llama")
    eng = Engine(EngineConfig(max_total_tokens=2048, overlap=overlap), model=model)
    finalize, calls = eng.worker.finalize, []

    def fails_once(step):  # the fault injected: the real device does not fail on demand
        calls.append(step)
        if len(calls) == 2:
            raise RuntimeError("device lost the step")
        return finalize(step)

    eng.worker.finalize = fails_once

    async def main():
        failed = await asyncio.wait_for(collect(eng, req("a", rand_prompt(20, 1), 8)), 60)
        return failed, await asyncio.wait_for(collect(eng, req("b", rand_prompt(25, 3), 8)), 60)

    (_, out), (toks, last) = asyncio.run(main())
    assert out.finish_reason == "error" and out.error_code == "engine_error" and "device lost the step" in out.error
    assert toks == reference_greedy(model, rand_prompt(25, 3), 8) and last.finish_reason == "length"
    st = eng.stats()
    assert st["failed_steps"] == 1 and st["kv_pages_used"] == 0 and st["running"] == 0 and eng.error is None
    eng.shutdown()

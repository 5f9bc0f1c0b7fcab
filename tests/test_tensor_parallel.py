"""Tensor and pipeline parallel over mx.distributed: two ranks (processes) on loopback
with MLX's `ring` backend serve a tiny model split by mlx-lm's own `model.shard` (llama)
or `model.model.pipeline` (qwen3_next: a hybrid). Rank 0 takes the requests; rank 1
replays its schedule. Tokens equal mlx-lm's on the whole model (greedy)
and the single-rank engine's (seeded sampling, JSON schema), under batching, chunked
prefill, prefix hits and preemption, and prefix pages read back from disk; a rank that
dies fails the requests in flight."""

import asyncio
import itertools
import multiprocessing as mp
import os
import random
import time

import mlx.core as mx
import pytest
from conftest import default_tokenizer, reference_greedy, run_requests
from mlx.utils import tree_flatten
from tiny_models import make_tiny_model, save_tiny_model

from mlx_worker import Engine, EngineConfig, Request, SamplingParams
from mlx_worker.sampling.grammar import GrammarSpec
from mlx_worker.models.loader import load_sharded
from mlx_worker.distributed.ranks import free_port

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
SAMPLED = SamplingParams(max_tokens=10, temperature=0.8, top_p=0.9, seed=5, n=2)
STRUCTURED = SamplingParams(max_tokens=16, temperature=0.0, structured=GrammarSpec(json_schema=SCHEMA))


def prompts(n, lo, hi, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(100, 40000) for _ in range(rng.randrange(lo, hi))] for _ in range(n)]


BATCH = prompts(6, 3, 70, seed=1) + prompts(1, 90, 91, seed=2)  # the last one is chunked (32-token steps)
SHARED = prompts(1, 70, 71, seed=3)[0]
PREEMPT = prompts(4, 30, 40, seed=4)
AGAIN = prompts(3, 10, 20, seed=5)  # sent twice: the second time, drafted from the first's outputs
DISKED = prompts(1, 200, 201, seed=6)[0]  # 12 full pages of 16 tokens


def _collect(engine, rid, prompt, params):
    async def main():
        toks, last = {}, None
        async for out in engine.generate(Request(rid=rid, prompt_ids=prompt, params=params)):
            toks.setdefault(out.index, []).extend(out.token_ids)
            last = out
        return toks, last.num_cached_tokens

    return asyncio.run(main())


def _scenarios(engine_for, rank):
    """Every rank builds the same engines in the same order; rank 0 sends requests."""
    results = {}
    engine = engine_for(max_total_tokens=4096, max_batched_tokens=32)
    if rank == 0:
        results["batch"] = [toks for toks, _ in run_requests(engine, BATCH, 12)]
        results["hit"] = [_collect(engine, f"h{i}", SHARED + tail, SamplingParams(max_tokens=8, temperature=0.0))
                          for i, tail in enumerate(([7, 8, 9], [11, 12]))]
        results["sampled"] = _collect(engine, "s", BATCH[0], SAMPLED)[0]
        results["structured"] = _collect(engine, "j", BATCH[1], STRUCTURED)[0]
        engine.shutdown()
    engine.join(60)
    engine = engine_for(max_total_tokens=96, max_batched_tokens=64, page_size=16)  # 6 pages: preemption
    if rank == 0:
        results["preempt"] = [toks for toks, _ in run_requests(engine, PREEMPT, 16)]
        results["preemptions"] = engine.stats()["preemptions"]
        engine.shutdown()
    engine.join(60)
    return results


def _disk_restarts(engine_for, rank, directory):
    """Three engines in turn over one prefix_cache_dir (each rank files its share of every
    page under its own key); before the third, rank 1 loses its file of the 6th page.
    Rank 0's (tokens, cached tokens) of DISKED each time."""
    from mlx_worker.memory.paging import page_hashes

    results = []
    for turn in range(3):
        engine = engine_for(max_total_tokens=1024, prefix_cache_dir=directory)
        if rank == 0:
            (toks, last), = run_requests(engine, [DISKED], 8)
            results.append((toks, last.num_cached_tokens))
            engine.shutdown()
        engine.join(60)  # and the pages handed to the writer are on disk
        if turn == 1 and rank == 1:
            os.remove(engine.disk.files.path(page_hashes(DISKED[: 6 * 16], 16)[5]))
    return results


def _rank_main(rank, hosts, leader, task, arch, split, queue):
    import mlx_worker  # noqa: F401  (OpenBLAS before mlx)
    from mlx_worker.distributed.ranks import start_ranks

    try:
        ranks = start_ranks(rank, hosts, leader)
        if task.startswith("load "):  # rank's memory for loading only its shard of a saved model
            before = mx.get_active_memory()
            mx.reset_peak_memory()
            shard, _ = load_sharded(task[5:], "float32", ranks.group)
            weights = sum(v.nbytes for _, v in tree_flatten(shard.parameters()))
            queue.put((rank, (weights, mx.get_peak_memory() - before)))
            return
        if task.startswith("mtp "):  # each rank loads its shard of the checkpoint, and the whole MTP head
            engine = Engine(EngineConfig(model=task[4:], **{f"{split}_parallel_size": len(hosts)}, max_total_tokens=2048,
                                         max_batched_tokens=32, speculative={
                                             "method": "mtp", "num_draft_tokens": 3, "adaptive": False}), ranks=ranks)
            result = None
            if rank == 0:
                result = ([toks for toks, _ in run_requests(engine, AGAIN, 16)], engine.stats()["speculative"])
                engine.shutdown()
            engine.join(60)
            queue.put((rank, result))
            return
        model = make_tiny_model(arch)
        model.model.pipeline(ranks.group) if split == "pipeline" else model.shard(ranks.group)
        tokenizer = default_tokenizer()

        def engine_for(draft_model=None, **kw):
            return Engine(EngineConfig(**{f"{split}_parallel_size": len(hosts)}, **kw), model=model,
                          tokenizer=tokenizer, ranks=ranks, draft_model=draft_model)

        if task == "scenarios":
            result = _scenarios(engine_for, rank)
        elif task.startswith("disk "):
            result = _disk_restarts(engine_for, rank, task[5:])
        elif task in ("speculative", "draft"):  # every rank verifies the same rows (rank 0's drafts)
            spec = {"method": "suffix", "num_draft_tokens": 3, "adaptive": False}
            if task == "draft":  # each rank holds the whole (unsharded) target as its draft model
                engine = engine_for(max_total_tokens=4096, max_batched_tokens=16, draft_model=make_tiny_model(arch),
                                    speculative={**spec, "method": "draft", "draft_model": "whole"})
            else:
                engine = engine_for(max_total_tokens=4096, speculative=spec)
            result = None
            if rank == 0:
                first = [toks for toks, _ in run_requests(engine, AGAIN, 24)]
                result = (first + [toks for toks, _ in run_requests(engine, AGAIN, 24)], engine.stats()["speculative"])
                engine.shutdown()
            engine.join(60)
        else:  # "kill": rank 1 dies while rank 0 decodes; "fail<r>": a step fails on rank r only
            engine = engine_for(max_total_tokens=4096)
            if task == "kill" and rank == 1:
                time.sleep(1.0)
                os._exit(1)
            if task == f"fail{rank}":
                launch, calls = engine.worker.launch, itertools.count()

                def failing(plan):
                    if next(calls) == 5:
                        raise RuntimeError("injected step failure")
                    return launch(plan)

                engine.worker.launch = failing
            if rank != 0:
                engine.join()
                queue.put((rank, repr(engine.error)))
                return
            t = time.perf_counter()
            try:
                _collect(engine, "long", list(range(100, 150)), SamplingParams(max_tokens=100000, ignore_eos=True))
                result = ("finished", None, None)
            except RuntimeError as e:
                result = ("failed", repr(e.__cause__), time.perf_counter() - t)
            queue.put((rank, result))
            queue.close()
            queue.join_thread()
            os._exit(0)  # its engine thread waits on the dead rank forever: the group must restart
        queue.put((rank, result))
    except BaseException as e:  # noqa: BLE001 - reported to the test
        queue.put((rank, e))
        raise


def run_ranks(task, arch="llama", split="tensor", size=2, timeout=240):
    """Rank 0's result of `task` run by `size` ranks on loopback."""
    hosts = [f"127.0.0.1:{free_port()}" for _ in range(size)]
    leader = f"127.0.0.1:{free_port()}"
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_rank_main, args=(r, hosts, leader, task, arch, split, queue), daemon=True) for r in range(size)]
    for p in procs:
        p.start()
    try:
        results = {}
        deadline = time.monotonic() + timeout
        while 0 not in results:
            rank, result = queue.get(timeout=max(1, deadline - time.monotonic()))
            if isinstance(result, BaseException):
                raise AssertionError(f"rank {rank} failed") from result
            results[rank] = result
        return results[0]
    finally:
        for p in procs:  # a rank left in a collective by a failed one never ends
            p.join(30 if task == "scenarios" else 3)
            if p.is_alive():
                p.kill()


@pytest.mark.parametrize("arch, split", [("llama", "tensor"), ("qwen3_next", "pipeline")])
def test_two_ranks_equal_the_single_rank_engine(arch, split):
    model = make_tiny_model(arch)
    got = run_ranks("scenarios", arch, split)
    tokenizer = default_tokenizer()
    for prompt, toks in zip(BATCH, got["batch"]):
        assert toks == reference_greedy(model, prompt, 12)
    (first, cached0), (second, cached1) = got["hit"]
    assert first[0] == reference_greedy(model, SHARED + [7, 8, 9], 8)
    assert second[0] == reference_greedy(model, SHARED + [11, 12], 8)
    assert (cached0, cached1) == (0, 64)  # 4 whole pages of the shared 70 tokens
    single = Engine(EngineConfig(max_total_tokens=4096, max_batched_tokens=32), model=model, tokenizer=tokenizer)
    assert got["sampled"] == _collect(single, "s", BATCH[0], SAMPLED)[0]
    assert got["sampled"][0] != got["sampled"][1]  # n=2 really sampled
    assert got["structured"] == _collect(single, "j", BATCH[1], STRUCTURED)[0]
    single.shutdown()
    assert got["preemptions"] > 0
    for prompt, toks in zip(PREEMPT, got["preempt"]):
        assert toks == reference_greedy(model, prompt, 16)


def test_two_ranks_verify_drafts_as_one_engine():
    model = make_tiny_model("llama")
    got, stats = run_ranks("speculative")
    for prompt, toks in zip(AGAIN + AGAIN, got):
        assert toks == reference_greedy(model, prompt, 24)
    assert stats["accepted_tokens"] >= 40  # the second time round, most of each answer drafted and accepted


@pytest.mark.parametrize("arch, split", [("llama", "tensor"), ("qwen2", "pipeline")])
def test_two_ranks_verify_a_draft_models_drafts(arch, split):
    """The target's whole copy drafts on every rank (it keeps its KV through chunked
    prefill in 16-token steps): every draft right, tokens mlx-lm's."""
    model = make_tiny_model(arch)
    got, stats = run_ranks("draft", arch, split)
    for prompt, toks in zip(AGAIN + AGAIN, got):
        assert toks == reference_greedy(model, prompt, 24)
    assert stats["verify_rows"] > 0 and stats["acceptance_rate"] > 0.97, stats


def test_two_ranks_verify_an_mtp_heads_drafts(tmp_path):
    """Qwen3-Next split in two pipeline stages, its MTP head whole on both ranks (a
    checkpoint whose head drafts the token its model repeats): drafts taken, tokens mlx-lm's."""
    from mlx_lm import load as mlx_load
    from test_mtp import save_with_mtp

    save_with_mtp("qwen3_next", tmp_path / "mtp", repeating=True)
    model, _ = mlx_load(str(tmp_path / "mtp"))
    got, stats = run_ranks(f"mtp {tmp_path / 'mtp'}", "qwen3_next", "pipeline")
    for prompt, toks in zip(AGAIN, got):
        assert toks == reference_greedy(model, prompt, 16)
    assert stats["verify_rows"] > 0 and stats["acceptance_rate"] > 0.9, stats


@pytest.mark.parametrize("arch, split", [("llama", "tensor"), ("qwen3_next", "pipeline")])
def test_two_ranks_read_the_prefix_back_from_disk_as_far_as_both_have_it(tmp_path, arch, split):
    """The prefix cache's SSD tier on a replica over two Macs (here one directory, each
    rank's share of a page under its own key): a restart reads the prompt's 12 pages
    back; after rank 1 lost its file of the 6th page, both read back only the 5 before
    it (a rank that loaded a page the other computes again would part the group), or,
    a hybrid model, none: its only state snapshot on disk is after the 12th page."""
    model = make_tiny_model(arch)
    got = run_ranks(f"disk {tmp_path}", arch, split)
    want = reference_greedy(model, DISKED, 8)
    assert got == [(want, 0), (want, 12 * 16), (want, 5 * 16 if arch == "llama" else 0)]


def test_each_rank_holds_only_its_shard(tmp_path):
    from mlx_worker.models.gguf import default_model_path

    wide = dict(hidden_size=256, intermediate_size=1024, num_hidden_layers=4, vocab_size=1024)  # layers dominate
    path = save_tiny_model("llama", tmp_path / "m", tokenizer_dir=default_model_path(), **wide)
    whole = sum(v.nbytes for _, v in tree_flatten(make_tiny_model("llama", **wide).parameters()))
    weights, peak = run_ranks(f"load {path}")
    assert weights < 0.6 * whole  # half of every layer; embeddings and head stay whole
    assert peak < 0.75 * whole  # never the whole model, even while loading


def test_a_dead_rank_fails_the_requests_in_flight():
    outcome, cause, seconds = run_ranks("kill")
    assert outcome == "failed"
    assert "RankLost" in cause and "the group must restart" in cause
    assert seconds < 30


@pytest.mark.parametrize("rank", [0, 1])
def test_a_step_that_fails_on_one_rank_fails_the_group(rank):
    """The ranks must run the same steps: a step that failed on one rank only cannot be
    recovered from as a single engine does (the others may wait in its collectives)."""
    outcome, cause, seconds = run_ranks(f"fail{rank}")
    assert outcome == "failed"
    assert "RankLost" in cause and "the group must restart" in cause
    assert ("injected step failure" in cause) == (rank == 0)  # rank 1's own error is in its log
    assert seconds < 30


def test_a_rank_that_never_comes_fails_the_start_instead_of_hanging():
    from mlx_worker.distributed.ranks import start_ranks

    t = time.perf_counter()
    with pytest.raises(RuntimeError, match="1 of 1 follower ranks did not reach the leader"):
        start_ranks(0, [f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"], f"127.0.0.1:{free_port()}",
                    timeout=1)
    assert time.perf_counter() - t < 5


def test_a_model_without_tensor_parallel_support_is_refused(tmp_path):
    from mlx_worker.models.gguf import default_model_path

    path = save_tiny_model("gpt_bigcode", tmp_path / "m", tokenizer_dir=default_model_path())
    with pytest.raises(ValueError, match="gpt_bigcode has no tensor-parallel support"):
        load_sharded(str(path), "float32", mx.distributed.init())


def test_a_backend_that_cannot_start_says_so():
    from mlx_worker.distributed.ranks import init_group

    with pytest.raises(ValueError, match="backend must be one of"):
        init_group(0, ["127.0.0.1:1"], "nccl")
    if not mx.distributed.is_available("jaccl"):  # Linux, or a Mac without RDMA
        with pytest.raises(RuntimeError, match="'jaccl' is not available on this machine"):
            init_group(0, ["127.0.0.1:1", "127.0.0.1:2"], "jaccl", [[None, "rdma_en2"], ["rdma_en2", None]])

"""Tensor parallel on one machine: the same random-weight llama served by one engine
(TP=1) and by two ranks in two processes over MLX's `ring` backend on loopback (TP=2).

    python benchmarks/tensor_parallel.py [--concurrency 1 8] [--output-len 64] [--prompt-len 128]

Prints, for each concurrency: decode and end-to-end tok/s of TP=1 and TP=2; the leader's
side-channel cost per step (the commands it sends the other rank); and the latency of
one ring all-reduce of a decode step's hidden states, times the all-reduces per step
(2 per layer: attention output and MLP output). On one 2-core box both ranks share the
cores, so TP=2 cannot be faster here; the per-step costs are what carry over to Macs
(docs/cluster.md turns them into estimates for Ethernet, Thunderbolt and RDMA).
"""

import argparse
import asyncio
import multiprocessing as mp
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import mlx_worker  # noqa: E402,F401  (OpenBLAS before mlx on Linux)
import mlx.core as mx  # noqa: E402

from mlx_worker import Engine, EngineConfig, Request, SamplingParams  # noqa: E402
from mlx_worker.distributed.ranks import free_port, start_ranks  # noqa: E402
from random_models import CONFIGS, random_model  # noqa: E402
from traffic import prompts  # noqa: E402

ARCH = "llama"


def run(engine, ps, out_len, tag):
    """Concurrent greedy requests: e2e tok/s, decode tok/s (after the last first token)."""
    async def main():
        t0, firsts, counts = time.perf_counter(), [], []

        async def one(i, p):
            n, first = 0, None
            params = SamplingParams(max_tokens=out_len, ignore_eos=True, temperature=0.0)
            async for out in engine.generate(Request(rid=f"{tag}{i}", prompt_ids=p, params=params), detokenize=False):
                first = first or time.perf_counter()
                n += len(out.token_ids)
            firsts.append(first)
            counts.append(n)

        await asyncio.gather(*[one(i, p) for i, p in enumerate(ps)])
        t1 = time.perf_counter()
        decode_tokens = sum(counts) - len(ps)
        return {"e2e": sum(counts) / (t1 - t0), "decode": decode_tokens / (t1 - max(firsts))}

    return asyncio.run(main())


def scenario(engine, args, tag):
    run(engine, prompts(2, 16, seed=1), 4, f"{tag}warm")
    out = {}
    for c in args.concurrency:
        steps0 = engine.num_steps
        r = run(engine, prompts(c, args.prompt_len, seed=c), args.output_len, f"{tag}{c}-")
        r["steps"] = engine.num_steps - steps0
        out[c] = r
    return out


def all_reduce_us(group, rows, hidden, iters=100, repeats=5):
    """Median over `repeats` runs of the mean time of one all-reduce of (rows, hidden) fp32."""
    x = mx.ones((rows, hidden))
    for _ in range(iters):  # warm-up: both ranks are here
        mx.eval(mx.distributed.all_sum(x, group=group))
    runs = []
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(iters):
            mx.eval(mx.distributed.all_sum(x, group=group))
        runs.append(1e6 * (time.perf_counter() - t) / iters)
    return statistics.median(runs)


def rank_main(rank, hosts, leader, args, queue):
    ranks = start_ranks(rank, hosts, leader)
    hidden = CONFIGS[ARCH]["hidden_size"]
    ar = {c: all_reduce_us(ranks.group, c, hidden) for c in args.concurrency}  # both idle: before the engine
    idle = side_channel_us(ranks)
    model = random_model(ARCH)
    model.shard(ranks.group)
    engine = Engine(EngineConfig(tensor_parallel_size=2, max_total_tokens=32768), model=model, ranks=ranks)
    result = None
    if rank == 0:
        sent0, send_s0 = ranks.channel.num_sent, ranks.channel.send_s
        result = {"tp": scenario(engine, args, "tp")}
        ch = ranks.channel
        result["channel_us"] = 1e6 * (ch.send_s - send_s0) / max(1, ch.num_sent - sent0)
        engine.shutdown()
    else:
        engine.join()
    if rank == 0:
        result["all_reduce_us"], result["channel_idle_us"] = ar, idle
        queue.put(result)


def side_channel_us(ranks, iters=2000):
    """The leader's cost of one empty step message with nothing else running."""
    t = time.perf_counter()
    for _ in range(iters):
        ranks.channel.send([]) if ranks.leader else ranks.channel.recv()
    return 1e6 * (time.perf_counter() - t) / iters


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    args = ap.parse_args()
    cfg = CONFIGS[ARCH]
    print(f"random {ARCH}: {cfg['num_hidden_layers']} layers, hidden {cfg['hidden_size']}, "
          f"{cfg['num_attention_heads']} heads / {cfg['num_key_value_heads']} KV heads, float32, {mx.default_device()}")

    single = Engine(EngineConfig(max_total_tokens=32768), model=random_model(ARCH))
    tp1 = scenario(single, args, "one")
    single.shutdown()
    del single

    hosts = [f"127.0.0.1:{free_port()}" for _ in range(2)]
    leader = f"127.0.0.1:{free_port()}"
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=rank_main, args=(r, hosts, leader, args, queue)) for r in range(2)]
    for p in procs:
        p.start()
    res = queue.get(timeout=1800)
    for p in procs:
        p.join(60)

    per_step = 2 * cfg["num_hidden_layers"]
    print(f"\n{'rows':>5}{'TP=1 decode':>13}{'TP=2 decode':>13}{'TP=1 e2e':>10}{'TP=2 e2e':>10}"
          f"{'ring all-reduce us':>20}{'x per step':>12}{'= ms/step':>11}")
    for c in args.concurrency:
        a, b, us = tp1[c], res["tp"][c], res["all_reduce_us"][c]
        print(f"{c:>5}{a['decode']:>13.1f}{b['decode']:>13.1f}{a['e2e']:>10.1f}{b['e2e']:>10.1f}"
              f"{us:>20.1f}{per_step:>12}{us * per_step / 1e3:>11.2f}")
    print(f"\nleader's side channel (pickle + TCP send of the step's commands): {res['channel_us']:.1f} us per step "
          f"while serving, {res['channel_idle_us']:.1f} us alone")


if __name__ == "__main__":
    main()

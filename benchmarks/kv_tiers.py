"""KV memory tiers benchmark: quantized KV pages (`engine.kv_bits`) against full precision,
in one run, on the default model and config.

    python benchmarks/kv_tiers.py [--bits 8 4] [--pool-mb 256] [--context 1500] [--clients 16]
                                  [--max-tokens 64] [--quick]

quality     held text (this repository's docs) scored token by token: perplexity with
            the engine's pages (prompt logprobs) and with mlx-lm's own cache at the same
            settings (KVCache, QuantizedKVCache: the peer); and 8 chat prompts answered
            greedily by mlx-lm: how much of each answer equals the full-precision one
            (the share of tokens before the first difference); and whether the engine's
            answers equal mlx-lm's at the same settings token for token, batched (all 8 at
            once) and alone, and how much of them do when batched.
capacity    `clients` requests with distinct contexts of `context` tokens, all at once,
            into a pool of `pool-mb` MB (max_total_tokens at each precision's bytes a
            token): how many run at once at most, preemptions, the time until the last
            answer, and output tok/s.
speed       the same requests, 8 at once, in a pool large enough for all at either
            precision: decode tok/s, quantized over full precision.
disk        a `prefix`-token prompt computed (its time to first token), then, after a
            restart (a new engine on the same prefix_cache_dir), sent again: its pages
            come from the SSD tier; the second TTFT over the first, and the read rate
            (the OS page cache is dropped first where this process may).
agents      `sessions` agent sessions, each turn resending a shared system prompt and its
            own growing history, round robin, into a pool that holds the system prompt and
            about two histories:
            prefix hit rate and TTFT with the prefix cache in memory only, and with the
            SSD tier.
"""

import argparse
import asyncio
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx_worker  # noqa: E402,F401  (OpenBLAS before mlx on Linux)
import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402
from mlx_lm.generate import generate_step  # noqa: E402
from mlx_lm.models.cache import KVCache, QuantizedKVCache, make_prompt_cache  # noqa: E402

from mlx_worker import Engine, EngineConfig, Request, SamplingParams  # noqa: E402
from mlx_worker.models.loader import load_model  # noqa: E402
from common import ROOT, table  # noqa: E402

GROUP = 64
QUESTIONS = ["Explain how a bicycle stays upright.", "Write a short poem about the sea.",
             "What is a hash table? Give an example in Python.", "List five uses of copper.",
             "Summarize the plot of Romeo and Juliet.", "How do vaccines work?",
             "Write a function that reverses a linked list.", "Why is the sky blue?"]


def peer_cache(model, bits):
    return [QuantizedKVCache(group_size=GROUP, bits=bits) if type(c) is KVCache and bits else c
            for c in make_prompt_cache(model)]


def peer_nll(model, ids, bits):
    """Mean negative log-likelihood of ids[1:] in one forward over a fresh cache."""
    logits = model(mx.array([ids[:-1]]), cache=peer_cache(model, bits))[0].astype(mx.float32)
    logp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    return -float(mx.mean(mx.take_along_axis(logp, mx.array(ids[1:])[:, None], axis=-1)))


def peer_greedy(model, ids, bits, n):
    return [int(t) for t, _ in generate_step(mx.array(ids), model, max_tokens=n, prompt_cache=peer_cache(model, bits),
                                             sampler=lambda logits: mx.argmax(logits, axis=-1))]


def engine(model, tok, bits, max_total_tokens, **kw):
    return Engine(EngineConfig(max_total_tokens=max_total_tokens, kv_bits=bits, kv_group_size=GROUP, **kw),
                  model=model, tokenizer=tok)


async def answer(eng, rid, ids, params):
    toks, last = [], None
    async for out in eng.generate(Request(rid=rid, prompt_ids=ids, params=params)):
        toks += out.token_ids
        last = out
    return toks, last


def engine_nll(eng, ids):
    _, last = asyncio.run(answer(eng, "score", ids, SamplingParams(max_tokens=0, prompt_logprobs=0)))
    return -float(np.mean(last.prompt_logprobs[1:]))


def shared_prefix(a, b):
    n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return n / max(1, len(a))


def quality(model, tok, bits_list, n_texts, text_tokens, n_tokens):
    docs = " ".join(p.read_text() for p in sorted((ROOT / "docs").glob("*.md")))
    ids = tok.encode(docs)
    texts = [ids[i * text_tokens : (i + 1) * text_tokens] for i in range(n_texts)]
    chats = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True) for q in QUESTIONS]
    params = SamplingParams(max_tokens=n_tokens, temperature=0.0, ignore_eos=True)
    rows, full_answers = [], None
    for bits in [None, *bits_list]:
        eng = engine(model, tok, bits, 4 * text_tokens)
        try:
            ours = float(np.exp(np.mean([engine_nll(eng, t) for t in texts])))

            async def all_answers():
                return await asyncio.gather(*[answer(eng, f"q{i}", c, params) for i, c in enumerate(chats)])

            batched = [t for t, _ in asyncio.run(all_answers())]
            alone = [asyncio.run(answer(eng, f"a{i}", c, params))[0] for i, c in enumerate(chats)]
        finally:
            eng.shutdown()
        peer_answers = [peer_greedy(model, c, bits, n_tokens) for c in chats]
        full_answers = full_answers or peer_answers
        peer = float(np.exp(np.mean([peer_nll(model, t, bits) for t in texts])))
        agree = float(np.mean([shared_prefix(a, f) for a, f in zip(peer_answers, full_answers)]))
        rows.append(("full precision" if bits is None else f"kv_bits {bits}", f"{ours:.3f}", f"{peer:.3f}", agree,
                     f"{sum(a == b for a, b in zip(batched, peer_answers))}/{len(chats)}",
                     f"{sum(a == b for a, b in zip(alone, peer_answers))}/{len(chats)}",
                     float(np.mean([shared_prefix(a, b) for a, b in zip(batched, peer_answers)]))))
    print(f"\n## Quality ({n_texts} texts of {text_tokens} tokens; {len(chats)} answers of {n_tokens} tokens)\n")
    print(table(["KV", "perplexity (engine)", "perplexity (mlx-lm, same KV)", "answer shared with full precision",
                 "engine = mlx-lm, batched", "engine = mlx-lm, alone", "answer shared, batched"], rows))


def contexts(tok, n, length):
    docs = tok.encode(" ".join(p.read_text() for p in sorted((ROOT / "docs").glob("*.md"))))
    step = max(1, (len(docs) - length) // max(1, n))
    return [[tok.bos_token_id or 0] + docs[i * step : i * step + length - 1] for i in range(n)]


def load_run(eng, prompts, max_tokens):
    """All prompts at once: (seconds, output tokens, peak running, decode tok/s after the first tokens)."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    peak, firsts = 0, []

    async def one(i, ids):
        n, first = 0, None
        async for out in eng.generate(Request(rid=f"c{i}", prompt_ids=ids, params=params)):
            if first is None and out.token_ids:
                first = time.perf_counter()
            n += len(out.token_ids)
        firsts.append(first)
        return n

    async def main():
        nonlocal peak
        tasks = [asyncio.ensure_future(one(i, p)) for i, p in enumerate(prompts)]
        while not all(t.done() for t in tasks):
            peak = max(peak, eng.stats()["running"])
            await asyncio.sleep(0.05)
        return [t.result() for t in tasks]

    t0 = time.perf_counter()
    counts = asyncio.run(main())
    wall = time.perf_counter() - t0
    decode_span = wall - (max(firsts) - t0)
    return wall, sum(counts), peak, decode_span


def capacity(model, tok, bits_list, pool_mb, context, clients, max_tokens):
    prompts = contexts(tok, clients, context)
    rows = []
    for bits in [None, *bits_list]:
        probe = engine(model, tok, bits, 1024)
        per_token = probe.kv_bytes_per_token
        probe.shutdown()
        tokens = pool_mb * 2**20 // per_token
        eng = engine(model, tok, bits, tokens)
        try:
            asyncio.run(answer(eng, "warm", prompts[0][:64], SamplingParams(max_tokens=2)))
            wall, n, peak, _ = load_run(eng, prompts, max_tokens)
            preempted = eng.stats()["preemptions"]
        finally:
            eng.shutdown()
        rows.append(("full precision" if bits is None else f"kv_bits {bits}", per_token, tokens, peak, preempted,
                     wall, n / wall))
    print(f"\n## Capacity ({clients} requests of {context} + {max_tokens} tokens at once, a {pool_mb} MB pool)\n")
    print(table(["KV", "bytes a token", "pool tokens", "running at once (max)", "preemptions",
                 "last answer (s)", "output tok/s"], rows))


def speed(model, tok, bits_list, context, max_tokens, batch=8):
    prompts = contexts(tok, batch, context)
    rows, base = [], None
    for bits in [None, *bits_list, None]:  # full precision first and last: the CPU's drift shows
        eng = engine(model, tok, bits, 2 * batch * (context + max_tokens))
        try:
            asyncio.run(answer(eng, "warm", prompts[0][:64], SamplingParams(max_tokens=2)))
            wall, n, _, span = load_run(eng, prompts, max_tokens)
        finally:
            eng.shutdown()
        rate = batch * (max_tokens - 1) / span
        base = base or rate
        rows.append(("full precision" if bits is None else f"kv_bits {bits}", rate, rate / base))
    print(f"\n## Speed ({batch} requests of {context} + {max_tokens} tokens at once, every one in the pool)\n")
    print(table(["KV", "decode tok/s", "x full precision (first run)"], rows))


def drop_page_cache() -> bool:
    """Drop the OS page cache, so that reads come from the disk (root on Linux only)."""
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def ttft(eng, rid, ids):
    t0 = time.perf_counter()
    toks, last = asyncio.run(answer(eng, rid, ids, SamplingParams(max_tokens=1, temperature=0.0)))
    return time.perf_counter() - t0, last, toks


def disk_reload(model, tok, prefix):
    ids = contexts(tok, 1, prefix)[0]
    while len(ids) < prefix:  # the docs repeated to length
        ids += ids[1 : prefix - len(ids) + 1]
    with tempfile.TemporaryDirectory() as directory:
        eng = engine(model, tok, None, prefix + 64, prefix_cache_dir=directory)
        try:
            asyncio.run(answer(eng, "warm", ids[:64], SamplingParams(max_tokens=1)))
            first, _, toks = ttft(eng, "first", ids)
            eng.disk.flush(timeout=600)
        finally:
            eng.shutdown()
        dropped = drop_page_cache()
        eng = engine(model, tok, None, prefix + 64, prefix_cache_dir=directory)
        try:
            asyncio.run(answer(eng, "warm", ids[:64], SamplingParams(max_tokens=1)))
            second, last, again = ttft(eng, "second", ids)
            disk = eng.stats()["prefix_cache_disk"]
            page_bytes = eng.disk.page_bytes
        finally:
            eng.shutdown()
    assert again == toks, "the answer after the restart differs"
    read = disk["pages_loaded"] * page_bytes
    print(f"\n## SSD tier: a {prefix}-token prompt after a restart (page cache dropped: {dropped})\n")
    print(table(["prompt", "TTFT computed (s)", "TTFT from the SSD tier (s)", "ratio", "cached tokens",
                 "read (GB)", "read rate while loading (GB/s, upper bound on the TTFT)"],
                [(prefix, first, second, second / first, last.num_cached_tokens, read / 1e9, read / 1e9 / second)]))


def agents(model, tok, sessions, turns, system, turn_tokens, pool_tokens):
    docs = contexts(tok, 1, system + sessions * turns * turn_tokens + 8)[0]
    shared = docs[:system]
    text = docs[system:]
    rows = []
    for label, ssd in (("memory only", False), ("memory + SSD", True)):
        with tempfile.TemporaryDirectory() as directory:
            eng = engine(model, tok, None, pool_tokens, **({"prefix_cache_dir": directory} if ssd else {}))
            try:
                asyncio.run(answer(eng, "warm", shared[:64], SamplingParams(max_tokens=1)))
                times, hit, total = [], 0, 0
                history = [[] for _ in range(sessions)]
                for t in range(turns):
                    for s in range(sessions):
                        at = (t * sessions + s) * turn_tokens
                        history[s] += text[at : at + turn_tokens]
                        seconds, last, _ = ttft(eng, f"s{s}t{t}", shared + history[s])
                        if t:  # first turns are cold either way
                            times.append(seconds)
                            hit += last.num_cached_tokens
                            total += last.num_prompt_tokens
                        if eng.disk is not None:
                            eng.disk.flush()  # an agent's next turn comes after its tools ran
            finally:
                eng.shutdown()
        rows.append((label, hit / total, float(np.mean(times)), float(np.percentile(times, 90))))
    print(f"\n## Agent sessions ({sessions} sessions x {turns} turns: a {system}-token system prompt and "
          f"{turn_tokens} more tokens a turn; a {pool_tokens}-token pool; turns after the first)\n")
    print(table(["prefix cache", "hit rate", "TTFT mean (s)", "TTFT p90 (s)"], rows))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--bits", type=int, nargs="+", default=[8, 4])
    ap.add_argument("--pool-mb", type=int, default=256)
    ap.add_argument("--context", type=int, default=1500)
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--quick", action="store_true", help="small figures: a smoke run")
    ap.add_argument("--prefix", type=int, default=32768, help="disk: the prompt's tokens")
    ap.add_argument("--sessions", type=int, default=6)
    ap.add_argument("--parts", nargs="+", default=["quality", "capacity", "speed", "disk", "agents"])
    a = ap.parse_args()
    model, tok = load_model(a.model)
    if a.quick:
        a.pool_mb, a.context, a.clients, a.max_tokens, a.prefix, a.sessions = 16, 300, 6, 8, 2048, 3
    print(f"model {a.model or 'SmolLM2-135M-Instruct (default)'}, {mx.default_device()}, kv_group_size {GROUP}")
    if "quality" in a.parts:
        quality(model, tok, a.bits, 2 if a.quick else 4, 256 if a.quick else 1024, 8 if a.quick else 64)
    if "capacity" in a.parts:
        capacity(model, tok, a.bits, a.pool_mb, a.context, a.clients, a.max_tokens)
    if "speed" in a.parts:
        speed(model, tok, a.bits, a.context, a.max_tokens)
    if "disk" in a.parts:
        disk_reload(model, tok, a.prefix)
    if "agents" in a.parts:
        turns, system, turn = (3, 512, 128) if a.quick else (4, 2048, 256)
        agents(model, tok, a.sessions, turns, system, turn, pool_tokens=system + 2 * turns * turn)


if __name__ == "__main__":
    main()

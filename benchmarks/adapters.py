"""LoRA adapters benchmark: the base alone vs 1, 4 and 16 distinct adapters mixed in one
batch, under the churn load of benchmarks/engine.py, with mlx-lm's ways in the same run.

    python benchmarks/adapters.py [--model PATH] [--requests 32] [--rate 0.5] [--quick]

On the default model (SmolLM2-135M; float32 on a CPU), with random rank-8 adapters on
q/k/v/o of every layer (mlx-lm's format, made by its own `linear_to_lora_layers`):
  churn    one seeded Poisson schedule through the engine: the base alone, then each
           request under one of N adapters (round robin), N = 1, 4, 16: tok/s, TTFT, ITL;
           tok/s over the base's is the figure (target >= 0.85x at 16).
  peers    mlx-lm with the one adapter fused into the weights (`fuse`), through its
           BatchGenerator as mlx_lm.server drives it; and the way mlx_lm.server serves
           several adapters: one at a time, the model reloaded with the next request's
           adapter whenever it changes (requests in arrival order, batch 1).
  loading  model load time from disk (mlx_lm.load, the engine built around it), time to
           first token of a model that was not resident (load + the first request), and
           the first request's cost of an adapter not yet resident.
"""

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx_worker  # noqa: E402,F401  (OpenBLAS before mlx on Linux)
import mlx.core as mx  # noqa: E402
from mlx.utils import tree_flatten, tree_unflatten  # noqa: E402
from mlx_lm import load as mlx_load  # noqa: E402
from mlx_lm import stream_generate  # noqa: E402
from mlx_lm.sample_utils import make_sampler  # noqa: E402
from mlx_lm.tuner.utils import linear_to_lora_layers, load_adapters  # noqa: E402

from mlx_worker import Engine, EngineConfig, Request, SamplingParams  # noqa: E402
from mlx_worker.models.gguf import resolve_model  # noqa: E402
from mlx_worker.models.loader import load_model  # noqa: E402
from common import table  # noqa: E402
from engine import batch_generator_schedule  # noqa: E402  (benchmarks/engine.py)
from traffic import Trace, schedule, summarize  # noqa: E402

KEYS = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj"]
RANK = 8


def make_adapters(base: str, n: int, root: Path) -> list:
    """n random LoRA adapters of rank RANK in mlx-lm's format (B random: a zero B is the base)."""
    import json

    out = []
    for i in range(n):
        model, _ = mlx_load(base)
        mx.random.seed(100 + i)
        lora = {"rank": RANK, "scale": 2.0, "dropout": 0.0, "keys": KEYS}
        linear_to_lora_layers(model, len(model.layers), lora)
        weights = {k: (mx.random.normal(v.shape) * 0.02 if k.endswith("lora_b") else v)
                   for k, v in tree_flatten(model.trainable_parameters()) if k.endswith(("lora_a", "lora_b"))}
        path = root / f"adapter{i}"
        path.mkdir()
        mx.save_safetensors(str(path / "adapters.safetensors"), weights)
        (path / "adapter_config.json").write_text(json.dumps(
            {"fine_tune_type": "lora", "num_layers": len(model.layers), "lora_parameters": lora}))
        out.append(path)
    return out


async def _run(engine, sched, names, tag):
    trace = Trace.begin(time.perf_counter(), sched)

    async def one(i, a):
        await asyncio.sleep(max(0.0, trace.arrivals[i] - time.perf_counter()))
        req = Request(rid=f"{tag}-{i}", prompt_ids=a.prompt[:], adapter=names[i],
                      params=SamplingParams(max_tokens=a.max_tokens, ignore_eos=True, temperature=0.0))
        async for out in engine.generate(req):
            trace.tokens[i].extend([time.perf_counter()] * len(out.token_ids))

    await asyncio.gather(*[one(i, a) for i, a in enumerate(sched)])
    return summarize(trace)


def engine_churn(base, adapters, n, sched, args):
    """The schedule through an engine serving the first n adapters (0: the base alone)."""
    paths = {f"a{i}": str(p) for i, p in enumerate(adapters[:n])}
    engine = Engine(EngineConfig(model=base, adapters=paths, max_loaded_adapters=max(1, n),
                                 max_total_tokens=args.pool, dtype=args.dtype))
    try:
        names = [f"a{i % n}" if n else None for i in range(len(sched))]
        asyncio.run(_run(engine, sched[:2], names[:2], "warm"))
        return asyncio.run(_run(engine, sched, names, f"n{n}"))
    finally:
        engine.shutdown()


def fused(base, adapter, dtype):
    """mlx-lm's model with the adapter fused into its weights, in the engine's dtype."""
    model, _ = load_model(base, dtype)
    load_adapters(model, str(adapter))
    fused_layers = [(n, m.fuse()) for n, m in model.named_modules() if hasattr(m, "fuse")]
    model.update_modules(tree_unflatten(fused_layers))
    return model


def reload_per_adapter(base, adapters, n, sched, dtype):
    """mlx_lm.server with several adapters: one at a time, reloaded whenever the next
    request (in arrival order) names another; batch 1."""
    trace = Trace.begin(time.perf_counter(), sched)
    loaded, model, tok, reloads = None, None, None, 0
    greedy = make_sampler(0.0)
    for i, a in enumerate(sched):
        time.sleep(max(0.0, trace.arrivals[i] - time.perf_counter()))
        want = i % n
        if want != loaded:  # mlx_lm.server loads base + adapter again
            model, tok = load_model(base, dtype)
            load_adapters(model, str(adapters[want]))
            loaded, reloads = want, reloads + 1
        for r in stream_generate(model, tok, a.prompt, max_tokens=a.max_tokens, sampler=greedy):
            trace.tokens[i].append(time.perf_counter())
    return summarize(trace), reloads


def loading(base, adapters, dtype):
    t = time.perf_counter()
    load_model(base, dtype)
    load_s = time.perf_counter() - t
    t = time.perf_counter()
    engine = Engine(EngineConfig(model=base, adapters={"a0": str(adapters[0])}, max_total_tokens=8192, dtype=dtype))
    built = time.perf_counter()

    async def first(adapter):
        t0 = time.perf_counter()
        async for out in engine.generate(Request(rid=f"cold-{adapter}", prompt_ids=list(range(1000, 1100)),
                                                 adapter=adapter, params=SamplingParams(max_tokens=1))):
            return time.perf_counter() - t0

    try:
        ttft_base = asyncio.run(first(None))
        cold_total = built - t + ttft_base
        ttft_adapter = asyncio.run(first("a0"))  # loads a0 into a slot first
        warm_adapter = asyncio.run(first("a0"))
    finally:
        engine.shutdown()
    return load_s, built - t, cold_total, ttft_base, ttft_adapter, warm_adapter


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="HF id, mlx-lm dir or .gguf (default: embedded SmolLM2-135M)")
    ap.add_argument("--dtype", default="auto", help="the engine's and the peers' (auto: float32 on a CPU)")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--rate", type=float, default=0.5, help="arrivals per second")
    ap.add_argument("--prompt", type=int, nargs=2, default=[16, 1024], help="prompt tokens, LO HI")
    ap.add_argument("--output", type=int, nargs=2, default=[16, 256], help="output tokens, LO HI")
    ap.add_argument("--adapters", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--pool", type=int, default=32768, help="KV pool tokens")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="a smoke run: 6 requests, short prompts, 1 and 4 adapters")
    args = ap.parse_args()
    if args.quick:
        args.requests, args.rate, args.prompt, args.output, args.adapters = 6, 2.0, [16, 128], [4, 16], [1, 4]
    base = resolve_model(args.model)
    sched = schedule(args.requests, args.rate, tuple(args.prompt), tuple(args.output), seed=args.seed)
    print(f"# Adapters: {args.requests} requests, Poisson {args.rate}/s (seed {args.seed}), prompts "
          f"{args.prompt[0]}..{args.prompt[1]}, outputs {args.output[0]}..{args.output[1]} tokens, greedy; "
          f"rank-{RANK} LoRA on {', '.join(k.split('.')[-1] for k in KEYS)} of every layer; model {base}")
    with tempfile.TemporaryDirectory() as tmp:
        adapters = make_adapters(base, max(args.adapters), Path(tmp))
        rows, base_s = [], None
        for n in [0, *args.adapters]:
            s = engine_churn(base, adapters, n, sched, args)
            base_s = base_s or s
            rows.append([f"macfarm, {n} adapter{'s' * (n > 1)}" if n else "macfarm, base alone", s["tok_s"], s["tok_s"] / base_s["tok_s"],
                         1e3 * s["ttft_p50"], 1e3 * s["itl_p50"], 1e3 * s["itl_p95"]])
            print(rows[-1], flush=True)
        s = summarize(batch_generator_schedule(fused(base, adapters[0], args.dtype), sched))
        rows.append(["mlx-lm BatchGenerator, 1 adapter fused", s["tok_s"], s["tok_s"] / base_s["tok_s"],
                     1e3 * s["ttft_p50"], 1e3 * s["itl_p50"], 1e3 * s["itl_p95"]])
        print(rows[-1], flush=True)
        n = max(args.adapters)
        s, reloads = reload_per_adapter(base, adapters, n, sched, args.dtype)
        rows.append([f"mlx_lm.server way, {n} adapters ({reloads} reloads)", s["tok_s"], s["tok_s"] / base_s["tok_s"],
                     1e3 * s["ttft_p50"], 1e3 * s["itl_p50"], 1e3 * s["itl_p95"]])
        print("\n" + table(["system", "tok/s", "x base", "TTFT p50 ms", "ITL p50 ms", "ITL p95 ms"], rows))
        load_s, build_s, cold, ttft, ttft_a, warm_a = loading(base, adapters, args.dtype)
    print("\n" + table(["loading", "seconds"], [
        ["mlx_lm.load from disk (and the dtype cast)", load_s], ["engine built (load + pool + probes)", build_s],
        ["first token of a model not resident (build + first request)", cold], ["first request, base (100 tokens)", ttft],
        ["first request under an adapter not resident (loads it)", ttft_a],
        ["next request under that adapter", warm_a]]))


if __name__ == "__main__":
    main()

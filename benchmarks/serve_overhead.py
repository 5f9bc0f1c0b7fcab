"""Serve overhead: the same requests through HTTP -> ingress -> router -> replica, and
on an in-process engine, one at a time. Prints p50/p99 latency and the difference.

Also prints Ray Serve's own floor on this machine: the same topology (HTTP proxy ->
FastAPI ingress deployment -> streaming DeploymentHandle -> a second deployment) whose
"replica" yields max_tokens integers at once: no model, tokenizer or router. What
macfarm adds is the difference to the engine; what it adds beyond Ray Serve is the
difference to the floor.

    python benchmarks/serve_overhead.py [--requests 50] [--max-tokens 8] [--model PATH]

Default model: a tiny random-weight llama (real engine, real Serve), so the forward pass
is small and the figures are dominated by what Serve adds.
"""

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import httpx  # noqa: E402
from fastapi import FastAPI, Request as HTTPRequest  # noqa: E402
from fastapi.responses import StreamingResponse  # noqa: E402
from ray import serve  # noqa: E402
from common import pct  # noqa: E402
from serve_fixtures import run_app, start_serve, stop_serve  # noqa: E402
from tiny_models import save_tiny_model  # noqa: E402

from mlx_worker import Engine, EngineConfig, Request, SamplingParams  # noqa: E402
from mlx_worker.models.gguf import default_model_path  # noqa: E402


floor_api = FastAPI()


@serve.deployment
class Counter:
    async def generate(self, n: int):
        for i in range(n):
            yield i


@serve.deployment
@serve.ingress(floor_api)
class FloorIngress:
    def __init__(self, counter):
        self.counter = counter.options(stream=True, method_name="generate")

    @floor_api.post("/v1/completions")
    async def completions(self, request: HTTPRequest):
        n = (await request.json())["max_tokens"]

        async def sse():
            async for i in self.counter.remote(n):
                yield f"data: {i}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(sse(), media_type="text/event-stream")


def prompts(tok, n):
    return [tok.encode(f"Request {i}: summarize the history of topic number {i * 13}.") for i in range(n)]


async def in_process(engine, ps, max_tokens):
    lat, ttft = [], []
    for i, p in enumerate(ps):
        t0 = time.perf_counter()
        first = None
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        async for _ in engine.generate(Request(rid=f"ip{i}", prompt_ids=p, params=params)):
            first = first or time.perf_counter()
        lat.append(time.perf_counter() - t0)
        ttft.append(first - t0)
    return lat, ttft


async def over_http(base, ps, max_tokens):
    lat, ttft = [], []
    async with httpx.AsyncClient(timeout=120) as ac:
        for p in ps:
            body = {"prompt": p, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True}
            t0 = time.perf_counter()
            first = None
            async with ac.stream("POST", f"{base}/v1/completions", json=body) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: ") and first is None:
                        first = time.perf_counter()
            lat.append(time.perf_counter() - t0)
            ttft.append(first - t0)
    return lat, ttft


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=50)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--model", default=None, help="mlx-lm dir (default: a tiny random llama)")
    ap.add_argument("--router", default="prefix", choices=["prefix", "pow2"])
    args = ap.parse_args()
    model = args.model or str(save_tiny_model("llama", Path(tempfile.mkdtemp()) / "tiny", default_model_path()))

    engine = Engine(EngineConfig(model=model, max_total_tokens=8192))
    ps = prompts(engine.tokenizer, args.requests)
    asyncio.run(in_process(engine, ps[:5], args.max_tokens))  # warm-up
    ip_lat, ip_ttft = asyncio.run(in_process(engine, ps, args.max_tokens))
    engine.shutdown()

    base = start_serve()
    run_app(base, "bench", "/", model=model, engine={"max_total_tokens": 8192}, router=args.router)
    asyncio.run(over_http(base, ps[:5], args.max_tokens))
    http_lat, http_ttft = asyncio.run(over_http(base, ps, args.max_tokens))
    serve.run(FloorIngress.bind(Counter.bind()), name="floor", route_prefix="/floor")
    asyncio.run(over_http(f"{base}/floor", ps[:5], args.max_tokens))
    fl_lat, fl_ttft = asyncio.run(over_http(f"{base}/floor", ps, args.max_tokens))
    stop_serve()

    print(f"\n## Serve overhead ({args.requests} sequential requests, {args.max_tokens} output tokens, streamed)")
    print(f"{'path':<28}{'latency p50':>14}{'p99':>10}{'TTFT p50':>12}{'p99':>10}   (ms)")
    for name, lat, ttft in (("engine in-process", ip_lat, ip_ttft), ("HTTP via Serve + router", http_lat, http_ttft),
                            ("Ray Serve floor (no work)", fl_lat, fl_ttft)):
        print(f"{name:<28}{pct(lat, .5) * 1e3:>14.1f}{pct(lat, .99) * 1e3:>10.1f}{pct(ttft, .5) * 1e3:>12.1f}{pct(ttft, .99) * 1e3:>10.1f}")
    d50 = (statistics.median(http_lat) - statistics.median(ip_lat)) * 1e3
    d99 = (pct(http_lat, .99) - pct(ip_lat, .99)) * 1e3
    print(f"added by Serve: p50 {d50:.1f} ms, p99 {d99:.1f} ms (target p50 <= 10 ms)")
    f50 = (statistics.median(http_lat) - statistics.median(ip_lat) - statistics.median(fl_lat)) * 1e3
    print(f"Ray Serve's own floor: p50 {statistics.median(fl_lat) * 1e3:.1f} ms; "
          f"macfarm's ingress, router and replica add {f50:.1f} ms beyond it")


if __name__ == "__main__":
    main()

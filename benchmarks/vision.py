"""Vision benchmark: requests with one image through the engine at 1, 4 and 16 concurrent,
against mlx-vlm's own generation (batch 1) in the same run, and a conversation's second
turn about the same image (a prefix hit) against its first.

    python benchmarks/vision.py [--concurrency 1 4 16] [--max-tokens 32] [--requests 16]
    python benchmarks/vision.py --burst [--streams 4] [--images 4] [--tokens-per-image 64]

model       a random-weight Gemma 3 vision checkpoint of mlx-vlm's classes at a small
            real size (no vision checkpoint can be downloaded here): a SigLIP tower of 12
            layers (hidden 768, 224 px, 256 patches) and a 30-layer text model of
            SmolLM2-135M's shape; 256 image tokens an image (as Gemma 3's). Written once under
            ~/.cache/macfarm/bench/. --model PATH runs a real checkpoint instead.
TTFT        from a request's submission to its first token (p50 over the cell's requests);
            all requests of a cell are sent at once (c client loops, each one after another).
tok/s       per request: a request's tokens after its first over their time, averaged;
            throughput: every token of the cell over its wall time, prefills included.
peer        mlx-vlm's `stream_generate`, one request after another (it serves one at a time).
second turn the same conversation with the model's answer and a follow-up question: its
            TTFT over the first turn's (the image's pages come from the prefix cache), and
            over the same second-turn prompt sent cold (another image).
--burst     text streams decoding while a burst of image requests arrives at once (the
            checkpoint with --tokens-per-image image tokens, 64 by default: small images
            on the same tower): the streams' gaps between tokens from the burst until the
            last image request's first token (p50, p99, longest), and the image requests'
            TTFT. The step budget prices the tower (docs/engine.md): a step that decodes
            runs a second prompt's images only within its gap.
"""

import argparse
import asyncio
import time
from pathlib import Path

import numpy as np
from common import ms, pct, table

import mlx_worker  # noqa: F401  (OpenBLAS before mlx on Linux)
from mlx_worker import Engine, EngineConfig, Request, SamplingParams

CACHE = Path.home() / ".cache" / "macfarm" / "bench"
TEXT = dict(hidden_size=576, num_hidden_layers=30, intermediate_size=1536, num_attention_heads=9,
            num_key_value_heads=3, head_dim=64, query_pre_attn_scalar=64, sliding_window=512, sliding_window_pattern=6)
VISION = dict(hidden_size=768, num_hidden_layers=12, intermediate_size=3072, num_attention_heads=12)
QUESTIONS = ["What is in this picture?", "Describe the colours you see.", "Is there any text in this image?",
             "What would you name this picture?"]


def checkpoint(tokens_per_image: int = 256) -> Path:
    from tiny_vision import save_tiny_gemma3_vision

    path = CACHE / f"gemma3-vision-small-{tokens_per_image}"
    if not (path / "model.safetensors").exists():
        save_tiny_gemma3_vision(path, tokens_per_image=tokens_per_image, image_size=224, text=TEXT, vision=VISION,
                                scale=1.0)
    return path


def picture(seed: int):
    from PIL import Image

    rng = np.random.RandomState(seed)
    return Image.fromarray((rng.rand(300, 400, 3) * 255).astype(np.uint8))


def conversation(i: int, answer: str = None) -> list:
    first = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTIONS[i % len(QUESTIONS)]}]}]
    if answer is None:
        return first
    return first + [{"role": "assistant", "content": [{"type": "text", "text": answer}]},
                    {"role": "user", "content": [{"type": "text", "text": "Now say it in one short sentence."}]}]


def render(processor, messages) -> str:
    return processor.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


async def run_cell(engine, requests, concurrency):
    """The requests through `concurrency` client loops: TTFTs, a request's decode tok/s on
    average, the cell's throughput, and the answers."""
    ttfts, rates, answers = [], [], {}
    total, began = 0, time.perf_counter()

    async def loop(j):
        for i in range(j, len(requests), concurrency):
            start, first, n = time.perf_counter(), None, 0
            out_ids = []
            async for out in engine.generate(requests[i]):
                if out.token_ids and first is None:
                    first = time.perf_counter()
                    ttfts.append(first - start)
                n += len(out.token_ids)
                out_ids += out.token_ids
            rates.append((n - 1) / (time.perf_counter() - first))
            nonlocal total
            total += n
            answers[i] = out_ids

    await asyncio.gather(*[loop(j) for j in range(concurrency)])
    return ttfts, (sum(rates) / len(rates), total / (time.perf_counter() - began)), answers


def engine_request(engine, rid, messages, image, max_tokens):
    ids, images = engine.model.prompt(render(engine.model.processor, messages), [image])
    return Request(rid=rid, prompt_ids=ids, images=images, params=SamplingParams(max_tokens=max_tokens, temperature=0.0))


def peer(path, n, max_tokens):
    """mlx-vlm's stream_generate, one request after another: TTFTs, (a request's decode
    tok/s on average, throughput), answers."""
    from mlx_vlm import load, stream_generate

    vlm, processor = load(str(path))
    ttfts, rates, answers, began = [], [], [], time.perf_counter()
    for i in range(n):
        start, first, ids = time.perf_counter(), None, []
        for r in stream_generate(vlm, processor, render(processor, conversation(i)), image=[picture(i)],
                                 max_tokens=max_tokens, temperature=0.0):
            if first is None:
                first = time.perf_counter()
            ids.append(r.token)
        rates.append((len(ids[:max_tokens]) - 1) / (time.perf_counter() - first))
        ttfts.append(first - start)
        answers.append(ids[:max_tokens])
    return ttfts, (sum(rates) / n, n * max_tokens / (time.perf_counter() - began)), answers


async def burst(engine, streams: int, images: int):
    """Text streams decoding, then `images` image requests at once: the streams' gaps
    between tokens while the burst is taken in, and the image requests' TTFTs."""
    stamps = {j: [] for j in range(streams)}
    ttfts = []

    async def text(j):
        messages = [{"role": "user", "content": [{"type": "text", "text": f"Tell a long story, number {j}."}]}]
        ids = engine.tokenizer.encode(render(engine.model.processor, messages), add_special_tokens=False)
        req = Request(rid=f"s{j}", prompt_ids=ids, params=SamplingParams(max_tokens=400, ignore_eos=True,
                                                                          temperature=0.0))
        async for out in engine.generate(req):
            stamps[j] += [time.perf_counter()] * len(out.token_ids)

    async def image(i):
        start = time.perf_counter()
        async for out in engine.generate(engine_request(engine, f"b{i}", conversation(i), picture(7000 + i), 8)):
            if out.token_ids:
                ttfts.append(time.perf_counter() - start)
                break

    tasks = [asyncio.create_task(text(j)) for j in range(streams)]
    while min(len(v) for v in stamps.values()) < 20:  # all decoding, steps measured
        await asyncio.sleep(0.01)
    began = time.perf_counter()
    await asyncio.gather(*[image(i) for i in range(images)])
    ended = time.perf_counter()
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    gaps = [b - a for v in stamps.values() for a, b in zip(v, v[1:]) if b > began and a < ended and b > a]
    return gaps, ttfts


def main_burst(args):
    path = Path(args.model) if args.model else checkpoint(args.tokens_per_image)
    engine = Engine(EngineConfig(model=str(path)))
    try:
        warm = engine_request(engine, "warm", conversation(99), picture(99), 4)
        asyncio.run(run_cell(engine, [warm], 1))
        gaps, ttfts = asyncio.run(burst(engine, args.streams, args.images))
        cost = engine.stats()["step_cost"]
    finally:
        engine.shutdown()
    print(f"## vision: {args.images} image requests at once while {args.streams} text streams decode "
          f"({path.name})\n")
    print(table(["stream gap p50 ms", "p99 ms", "longest ms", "image TTFT p50 ms", "longest ms"],
                [(ms(gaps, 0.5), ms(gaps, 0.99), ms(gaps, 1.0), ms(ttfts, 0.5), ms(ttfts, 1.0))]))
    print(f"\nstep cost fitted: {cost}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--requests", type=int, default=16, help="requests per cell (at least the concurrency)")
    ap.add_argument("--burst", action="store_true", help="streams' token gaps while image requests arrive")
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--images", type=int, default=4)
    ap.add_argument("--tokens-per-image", type=int, default=64, help="--burst's checkpoint")
    args = ap.parse_args()
    if args.burst:
        return main_burst(args)
    path = Path(args.model) if args.model else checkpoint()

    rows = []
    p_ttfts, p_rate, p_answers = peer(path, 4, args.max_tokens)
    rows.append(("mlx-vlm stream_generate", 1, f"{1e3 * pct(p_ttfts, 0.5):.0f}", *p_rate, 1.0))
    engine = Engine(EngineConfig(model=str(path)))
    try:
        warm = engine_request(engine, "warm", conversation(99), picture(99), 4)
        asyncio.run(run_cell(engine, [warm], 1))
        for c in args.concurrency:
            n = max(c, args.requests)
            reqs = [engine_request(engine, f"c{c}-{i}", conversation(i), picture(1000 * c + i), args.max_tokens)
                    for i in range(n)]
            ttfts, rate, _ = asyncio.run(run_cell(engine, reqs, c))
            rows.append(("engine", c, f"{1e3 * pct(ttfts, 0.5):.0f}", *rate, rate[1] / p_rate[1]))
        # mlx-vlm's answers, token for token (the peer's first requests again, on the engine)
        reqs = [engine_request(engine, f"same-{i}", conversation(i), picture(i), args.max_tokens) for i in range(4)]
        _, _, answers = asyncio.run(run_cell(engine, reqs, 4))
        same = sum(answers[i] == p_answers[i] for i in range(4))
        # A conversation's second turn about the same image, against its first and a cold one.
        turns = []
        for k in range(3):
            image = picture(5000 + k)
            first = engine_request(engine, f"t1-{k}", conversation(k), image, args.max_tokens)
            t1, _, a = asyncio.run(run_cell(engine, [first], 1))
            answer = engine.tokenizer.decode(a[0])
            second = engine_request(engine, f"t2-{k}", conversation(k, answer), image, args.max_tokens)
            t2, _, _ = asyncio.run(run_cell(engine, [second], 1))
            cold = engine_request(engine, f"cold-{k}", conversation(k, answer), picture(6000 + k), args.max_tokens)
            t3, _, _ = asyncio.run(run_cell(engine, [cold], 1))
            turns.append((t1[0], t2[0], t3[0], len(second.prompt_ids)))
    finally:
        engine.shutdown()

    print(f"## vision: one image a request ({path.name}, max_tokens {args.max_tokens})\n")
    print(table(["server", "concurrent", "TTFT p50 ms", "tok/s per request", "throughput tok/s",
                 "throughput over mlx-vlm"], rows))
    print(f"\nengine answers equal to mlx-vlm's, token for token: {same} of 4\n")
    t1, t2, t3, n = (float(np.median([t[i] for t in turns])) for i in range(4))
    print(table(["turn", "prompt tokens", "TTFT ms", "over first turn", "over the same prompt cold"],
                [("first (image + question)", len(reqs[0].prompt_ids), f"{1e3 * t1:.0f}", 1.0, None),
                 ("second, same image (prefix hit)", int(n), f"{1e3 * t2:.0f}", t2 / t1, t2 / t3),
                 ("second, another image (cold)", int(n), f"{1e3 * t3:.0f}", t3 / t1, 1.0)]))


if __name__ == "__main__":
    main()

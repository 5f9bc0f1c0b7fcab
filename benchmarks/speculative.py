"""Speculative decoding benchmark: the engine with `speculative` off and on, in one run,
on copy-heavy and free-form requests at 1, 8 and 32 concurrent requests.

    python benchmarks/speculative.py [--model PATH] [--concurrency 1 8 32] [--max-tokens 160]
                                     [--methods ngram suffix draft] [--draft-model PATH]
                                     [--workloads copy-heavy free-form] [--order abba|ab] [--quick]
                                     [--background-prompt TOKENS]

copy-heavy  rewrite a file exactly, rename a function in it, repeat a text: most of the
            answer is in the prompt (what coding agents and editors ask).
free-form   stories and explanations: little to copy.
--background-prompt TOKENS: one more client sends prompts of TOKENS tokens (1 token out)
            back to back meanwhile, so that most steps carry a prefill chunk beside the
            decoding rows (a farm where long agent prompts keep arriving).
Each cell runs `concurrency` client loops, each sending its share of the requests one
after another, through one engine (the default config and pool, one warm-up request
first); decode tok/s counts the tokens after each request's first while every loop was
busy (the batch at its full size), `per request` is a request's own decode tok/s on
average (what a user waits for), and the ratios are over the same cell without
speculation. With --order abba (the default) each cell runs off, on, on, off and
averages, so that the CPU's drift over minutes cancels; acceptance is the last run's. The greedy answers must be
the same on and off (the run fails otherwise).

peer        mlx-lm's own speculative generation at batch 1 (`stream_generate` with a
            draft model, as `mlx_lm.generate --draft-model` runs it): the model itself
            without drafts, and drafted by a model made of its first DRAFT_LAYERS layers
            (a default model has no smaller sibling with its tokenizer to draft for it).
            The engine's method draft uses the same draft unless --draft-model names one.
"""

import argparse
import asyncio
import copy
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx_worker  # noqa: E402,F401  (OpenBLAS before mlx on Linux)
from mlx_lm import stream_generate  # noqa: E402

from mlx_worker import Engine, EngineConfig, Request, SamplingParams  # noqa: E402
from mlx_worker.models.loader import load_model  # noqa: E402
from common import table  # noqa: E402

DRAFT_LAYERS = 6
NAMES = ["parse", "render", "merge", "split", "score", "fetch", "store", "check", "build", "clean", "count", "route"]
TOPICS = ["a lighthouse keeper", "the water cycle", "a robot learning to paint", "how bridges stand",
          "a market in the rain", "why the sky is blue", "a cat who runs a bakery", "volcanoes",
          "the first day at a new school", "how a bicycle works", "a dragon afraid of heights", "tides"]


def source_file(i: int) -> str:
    """A small Python module, different for each i."""
    a, b, c = NAMES[i % 12], NAMES[(i + 5) % 12], NAMES[(i + 7) % 12]
    return (f"import json\n\n\ndef {a}_items(items, limit={10 + i}):\n    result = []\n    for item in items:\n"
            f"        if len(result) >= limit:\n            break\n        result.append(item.strip())\n"
            f"    return result\n\n\ndef {b}_record(record):\n    data = json.loads(record)\n"
            f"    data[\"{c}\"] = data.get(\"{c}\", 0) + {i}\n    return json.dumps(data)\n\n\n"
            f"class {c.title()}Store:\n    def __init__(self):\n        self.items = {{}}\n\n"
            f"    def add(self, key, value):\n        self.items[key] = value\n\n"
            f"    def get(self, key):\n        return self.items.get(key)\n")


def copy_heavy(i: int) -> list:
    code = source_file(i)
    a = NAMES[i % 12]
    asks = [f"Here is my code:\n```python\n{code}```\nRewrite it exactly, in a code block.",
            f"Rename the function {a}_items to {a}_all in this file and show the whole file:\n```python\n{code}```",
            f"Repeat this code exactly, in a code block:\n```python\n{code}```"]
    return [{"role": "user", "content": asks[i % 3]}]


def free_form(i: int) -> list:
    asks = ["Write a short story about {}.", "Explain {} to a ten-year-old.", "Write a poem about {}."]
    return [{"role": "user", "content": asks[i % 3].format(TOPICS[i % 12])}]


WORKLOADS = {"copy-heavy": copy_heavy, "free-form": free_form}
HEADERS = ["workload", "concurrent", "speculative", "decode tok/s", "per request", "acceptance", "tokens/verify",
           "ratio", "ratio per request"]


def first_layers(model, n=DRAFT_LAYERS):
    """The model cut after its first n layers (sharing their weights): a draft for it."""
    draft = copy.copy(model)
    draft.model = copy.copy(model.model)
    draft.model.layers = model.model.layers[:n]
    return draft


def run_engine(model, tok, spec, prompts, concurrency, max_tokens, draft=None, background=0):
    config = EngineConfig(speculative=copy.deepcopy(spec))
    engine = Engine(config, model=model, tokenizer=tok, draft_model=draft)
    asyncio.run(warm_up(engine, prompts[0]))
    answers, rate, per_request = asyncio.run(cell(engine, prompts, concurrency, max_tokens, background))
    stats = engine.stats()["speculative"]
    engine.shutdown()
    return answers, rate, per_request, stats


async def warm_up(engine, prompt):
    async for _ in engine.generate(Request(rid="warm-up", prompt_ids=prompt,
                                           params=SamplingParams(max_tokens=16, temperature=0.0))):
        pass


async def cell(engine, prompts, concurrency, max_tokens, background=0):
    """The prompts through `concurrency` client loops: (answers, decode tok/s while every
    loop was busy, a request's own decode tok/s on average). The first measures the batch
    at full size: from the moment every loop has a first token to the moment one loop is
    done; the second, a request's tokens after its first over their time. `background`:
    prompts of this many tokens arrive meanwhile, one after another."""
    events, spans, starts, ends = [], [], [], []

    async def loop(j):
        answers = {}
        for i in range(j, len(prompts), concurrency):
            params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
            toks, first = [], None
            async for out in engine.generate(Request(rid=f"r{i}", prompt_ids=prompts[i], params=params)):
                now = time.perf_counter()
                if out.token_ids and first is None:
                    first = now
                    if i == j:
                        starts.append(now)
                else:
                    events.append((now, len(out.token_ids)))
                toks += out.token_ids
            answers[i] = toks
            spans.append((first, time.perf_counter(), len(toks) - 1))
        ends.append(time.perf_counter())
        return answers

    async def prefill_load():
        """One more client sending long prompts (each new: no prefix hit) for 1 token, back to back."""
        i = 0
        while len(ends) < concurrency:
            prompt = [100 + (i * 7919 + t * 104729) % 40000 for t in range(background)]
            async for _ in engine.generate(Request(rid=f"bg{i}", prompt_ids=prompt,
                                                   params=SamplingParams(max_tokens=1, temperature=0.0))):
                pass
            i += 1

    loops = [loop(j) for j in range(concurrency)] + ([prefill_load()] if background else [])
    results = (await asyncio.gather(*loops))[:concurrency]
    answers = {i: t for r in results for i, t in r.items()}
    t0, t1 = max(starts), min(ends)
    full = sum(n for t, n in events if t0 < t <= t1) / (t1 - t0)
    per_request = [n / (e - f) for f, e, n in spans if n > 0]
    return answers, full, sum(per_request) / len(per_request)


def mlx_lm_peer(model, tok, prompts, max_tokens):
    """mlx-lm at batch 1: plain, and with its speculative generation (a draft model)."""
    draft = first_layers(model)
    rows = []
    for name, kw in [("mlx-lm stream_generate", {}),
                     (f"mlx-lm stream_generate, draft model ({DRAFT_LAYERS} layers)", {"draft_model": draft,
                                                                                     "num_draft_tokens": 3})]:
        tokens = seconds = drafted = 0
        for p in prompts:
            t, n = None, 0
            for r in stream_generate(model, tok, p, max_tokens=max_tokens, **kw):
                if t is None:
                    t = time.perf_counter()
                else:
                    n += 1
                    drafted += bool(r.from_draft)
            seconds += time.perf_counter() - t
            tokens += n
        rows.append((name, tokens / seconds, drafted / max(1, tokens) if kw else None))
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--methods", nargs="+", default=["ngram"], choices=["ngram", "suffix", "draft"])
    ap.add_argument("--draft-model", default=None, help=f"method draft's model (default: the first {DRAFT_LAYERS} layers)")
    ap.add_argument("--order", choices=["abba", "ab"], default="abba",
                    help="abba: off, on, on, off in each cell, figures averaged (the CPU's speed drifts)")
    ap.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    ap.add_argument("--rounds", type=int, default=2, help="requests per client loop")
    ap.add_argument("--quick", action="store_true", help="concurrency 1 and 8, 64 tokens")
    ap.add_argument("--background-prompt", type=int, default=0, metavar="TOKENS",
                    help="meanwhile, prompts of TOKENS tokens arrive one after another (1 token each): decode beside long prefill")
    args = ap.parse_args()
    if args.quick:
        args.concurrency, args.max_tokens, args.rounds = [1, 8], 64, 2
    model, tok = load_model(args.model)
    rows, failures = [], []
    for workload in args.workloads:
        make = WORKLOADS[workload]
        for c in args.concurrency:
            prompts = [tok.apply_chat_template(make(i), add_generation_prompt=True) for i in range(c * args.rounds)]
            configs = ["off"] + args.methods
            order = configs + configs[::-1] if args.order == "abba" else configs  # abba: drift cancels
            runs = {}
            for name in order:
                spec = None if name == "off" else {"method": name}
                draft = None
                if name == "draft":
                    spec["draft_model"] = args.draft_model or f"first {DRAFT_LAYERS} layers"
                    draft = None if args.draft_model else first_layers(model)
                runs.setdefault(name, []).append(run_engine(model, tok, spec, prompts, c, args.max_tokens, draft,
                                                            args.background_prompt))
            base = runs["off"][0][0]
            mean = lambda name, i: sum(r[i] for r in runs[name]) / len(runs[name])  # noqa: E731
            for name in configs:
                if any(r[0] != base for r in runs[name]):
                    failures.append(f"{workload} @{c} {name}: answers differ from speculation off")
                st = runs[name][-1][3]
                rows.append((workload, c, name, mean(name, 1), mean(name, 2), st and st["acceptance_rate"],
                             st and st["tokens_per_verify_row"], mean(name, 1) / mean("off", 1),
                             mean(name, 2) / mean("off", 2)))
            print(table(HEADERS, rows[-1 - len(args.methods):]), flush=True)
    print("\n## engine, speculation off and on\n")
    print(table(HEADERS, rows))
    prompts = [tok.apply_chat_template(copy_heavy(i), add_generation_prompt=True) for i in range(args.rounds)]
    print("\n## peer at batch 1, copy-heavy\n")
    print(table(["generator", "decode tok/s", "share of tokens drafted"], mlx_lm_peer(model, tok, prompts,
                                                                                     args.max_tokens)))
    if failures:
        sys.exit("\n".join(failures))


if __name__ == "__main__":
    main()

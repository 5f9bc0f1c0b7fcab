"""Workloads and latency statistics for benchmarks/engine.py: random prompts, a seeded
Poisson arrival schedule, and per-request token timestamps summarized as tok/s, TTFT, ITL."""

import random
from dataclasses import dataclass
from typing import List, Tuple

from common import pct  # benchmarks/common.py


def token_ids(rng: random.Random, length: int) -> List[int]:
    return [rng.randrange(1000, 40000) for _ in range(length)]


def prompts(n: int, length: int, seed: int = 0) -> List[List[int]]:
    rng = random.Random(seed)
    return [token_ids(rng, length) for _ in range(n)]


@dataclass
class Arrival:
    at: float  # seconds after the start of the run
    prompt: List[int]
    max_tokens: int


def schedule(n: int, rate: float, prompt_lens: Tuple[int, int], output_lens: Tuple[int, int],
             seed: int = 0) -> List[Arrival]:
    """n requests with Poisson arrivals at `rate` per second (the first at 0); prompt and
    output lengths uniform over the inclusive (lo, hi) ranges."""
    rng = random.Random(seed)
    at, out = 0.0, []
    for _ in range(n):
        out.append(Arrival(at, token_ids(rng, rng.randint(*prompt_lens)), rng.randint(*output_lens)))
        at += rng.expovariate(rate)
    return out


@dataclass
class Trace:
    """One run of a schedule: absolute (perf_counter) arrival time and token timestamps
    per request. Tokens delivered together share a timestamp."""

    start: float
    arrivals: List[float]
    tokens: List[List[float]]

    @classmethod
    def begin(cls, start: float, sched: List[Arrival]) -> "Trace":
        return cls(start, [start + a.at for a in sched], [[] for _ in sched])


def summarize(trace: Trace) -> dict:
    """Output tok/s over the run (start to last token), TTFT (arrival to first token) and
    inter-token latency (gaps between a request's consecutive tokens) in seconds, and the
    mean number of requests in flight (arrival to last token)."""
    done = [(a, t) for a, t in zip(trace.arrivals, trace.tokens) if t]
    span = max(t[-1] for _, t in done) - trace.start
    ttft = [t[0] - a for a, t in done]
    itl = [y - x for _, t in done for x, y in zip(t, t[1:])]
    return {
        "tokens": sum(len(t) for _, t in done),
        "tok_s": sum(len(t) for _, t in done) / span,
        "ttft_p50": pct(ttft, 0.5), "ttft_p95": pct(ttft, 0.95),
        "itl_p50": pct(itl, 0.5), "itl_p95": pct(itl, 0.95), "itl_max": max(itl, default=float("nan")),
        "in_flight": sum(t[-1] - a for a, t in done) / span,
        "span": span,
    }


def full_batch_itl(trace: Trace) -> List[float]:
    """Gaps between a request's consecutive tokens while every request decodes: from the
    last first token to the first last token. An engine that starts rows as their prefills
    finish ends them one by one too; outside this window its batch is smaller than the
    peer's, so only inside it do both decode the same rows at the same contexts."""
    start = max(t[0] for t in trace.tokens if t)
    end = min(t[-1] for t in trace.tokens if t)
    return [y - x for t in trace.tokens for x, y in zip(t, t[1:]) if start <= x and y <= end]

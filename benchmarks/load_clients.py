"""Clients for load tests: a seeded mix of chat and completion requests through the openai
client (streamed and not; prompts of a few words to ~1,500 tokens, half behind one of a
few shared system prompts; 8-64 output tokens), with canaries (a greedy prompt whose
answer must never change), bad inputs (which must get a 400) and clients that leave
mid-stream. Each try waits at most `timeout` seconds (the openai client's own timeout,
which it sends as x-stainless-read-timeout); a 429 is retried twice after its
Retry-After, as the openai client does, then the request counts as refused.

Closed loops (`run_load`: N clients, each sending its next request when the last ends)
or open-loop Poisson arrivals (`run_arrivals`), with /v1/stats polled throughout.
"""

import asyncio
import random
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import httpx
import openai
from openai import AsyncOpenAI

WORDS = ("time person year way day thing man world life hand part child eye woman place work week case point "
         "government company number group problem fact water river mountain city music story garden").split()
SHARED = [" ".join(random.Random(i).choice(WORDS) for _ in range(150)) for i in range(4)]  # system prompts
CANARY = "The capital of France is"
TRIES = 3  # the first try and the openai client's 2 retries


@dataclass
class LoadResult:
    latencies: List[float] = field(default_factory=list)  # seconds, per completed request (its last try)
    errors: List[str] = field(default_factory=list)  # lost (admitted, never completed) or wrong answers
    stats_latencies: List[float] = field(default_factory=list)
    output_tokens: int = 0
    refusals: int = 0  # 429 answers, every try
    refused: int = 0  # requests still refused after their last retry
    retries_admitted: int = 0  # retries sent after a Retry-After and taken
    retries_refused: int = 0  # ... and refused again
    ttfts: List[float] = field(default_factory=list)  # streamed requests: try start to first token
    gaps: List[float] = field(default_factory=list)  # streamed requests: between tokens
    disconnects: int = 0  # clients that left mid-stream on purpose
    bad_inputs: int = 0  # answered 400, as they should be
    canaries: Dict[str, int] = field(default_factory=dict)  # answer -> count: one answer expected

    @property
    def lost(self) -> int:
        return len(self.errors)


def prompt_words(rng: random.Random) -> str:
    n = int(round(2 ** rng.uniform(1.5, 10.2)))  # 3 .. ~1,200 words (~1,500 tokens), log-uniform
    text = " ".join(rng.choice(WORDS) for _ in range(n))
    return f"{rng.choice(SHARED)}\n\n{text}" if rng.random() < 0.5 and n < 1000 else text


async def _call(client: AsyncOpenAI, model: str, rng: random.Random, kind: str, res: LoadResult, start: float) -> int:
    """One try of one request; the tokens it got."""
    if kind == "canary":
        r = await client.completions.create(model=model, prompt=CANARY, max_tokens=12, temperature=0)
        res.canaries[r.choices[0].text] = res.canaries.get(r.choices[0].text, 0) + 1
        return r.usage.completion_tokens
    if kind == "bad":
        try:
            await client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=-5)
        except openai.BadRequestError:
            res.bad_inputs += 1
            return 0
        raise AssertionError("a bad input was not refused with 400")
    text, stream = prompt_words(rng), kind in ("stream", "leave")
    kw = dict(model=model, max_tokens=rng.randrange(8, 65), temperature=rng.choice([0.0, 0.7]), stream=stream)
    if rng.random() < 0.5:
        r = await client.chat.completions.create(messages=[{"role": "user", "content": text}], **kw)
    else:
        r = await client.completions.create(prompt=text, **kw)
    if not stream:
        return r.usage.completion_tokens
    n, last = 0, None
    async for chunk in r:
        if not chunk.choices:
            continue
        now = time.perf_counter()
        if last is None:
            res.ttfts.append(now - start)
        else:
            res.gaps.append(now - last)
        last, n = now, n + 1
        if kind == "leave" and n == 2:
            await r.close()
            res.disconnects += 1
            return n
    if n == 0:
        raise AssertionError("empty stream")
    return n


async def one_request(client: AsyncOpenAI, model: str, rng: random.Random, res: LoadResult, timeout: float,
                      until: float, retry: bool = True) -> None:
    """One request of a random kind; a 429 is retried after its Retry-After while the
    run lasts (`until`, time.monotonic())."""
    x = rng.random()
    kind = "canary" if x < 0.04 else "bad" if x < 0.08 else "leave" if x < 0.12 else "stream" if x < 0.56 else "plain"
    for attempt in range(TRIES if retry else 1):
        start = time.perf_counter()
        try:
            n = await asyncio.wait_for(_call(client, model, rng, kind, res, start), timeout)
        except openai.RateLimitError as e:
            res.refusals += 1
            res.retries_refused += attempt > 0
            if e.code != "overloaded" or "retry-after" not in e.response.headers:
                res.errors.append(f"{kind}: a 429 without its error body or Retry-After: {e}"[:300])
            wait = float(e.response.headers.get("retry-after", 1))
            left = until - time.monotonic()
            if retry:  # a closed loop honours the last Retry-After too, within the run
                await asyncio.sleep(max(0.0, min(wait, left)))
            if not retry or attempt == TRIES - 1 or wait > left:
                res.refused += 1
                return
            continue
        except Exception as e:  # noqa: BLE001 - every failure is collected and asserted on
            res.errors.append(f"{kind}: {type(e).__name__}: {e}"[:300])
            return
        res.retries_admitted += attempt > 0
        if kind not in ("bad", "leave"):
            res.output_tokens += n
            res.latencies.append(time.perf_counter() - start)  # the try that was taken: within its timeout
        return


def _client(base: str, timeout: float) -> AsyncOpenAI:
    # Retries are ours (one_request) so that every 429 is seen; the policy is the openai client's.
    return AsyncOpenAI(base_url=f"{base}/v1", api_key="unused", timeout=timeout, max_retries=0,
                       http_client=httpx.AsyncClient(timeout=timeout, limits=httpx.Limits(max_connections=1000)))


async def client_loop(base: str, seed: int, until: float, res: LoadResult, timeout: float) -> None:
    rng = random.Random(seed)
    client = _client(base, timeout)
    try:
        model = (await client.models.list()).data[0].id
        while time.monotonic() < until:
            await one_request(client, model, rng, res, timeout, until)
    finally:
        await client.close()


async def arrivals(base: str, rate: float, until: float, res: LoadResult, timeout: float, seed: int) -> None:
    """Open loop: Poisson arrivals at `rate` per second, each one request, not retried."""
    rng = random.Random(seed)
    client = _client(base, timeout)
    try:
        model = (await client.models.list()).data[0].id
        tasks = []
        while time.monotonic() < until:
            tasks.append(asyncio.create_task(one_request(client, model, random.Random(rng.random()), res, timeout,
                                                         until, retry=False)))
            await asyncio.sleep(rng.expovariate(rate))
        await asyncio.gather(*tasks)
    finally:
        await client.close()


async def poll_stats(base: str, until: float, res: LoadResult, period: float = 0.5) -> None:
    async with httpx.AsyncClient(timeout=30) as http:
        while time.monotonic() < until:
            t = time.perf_counter()
            r = await http.get(f"{base}/v1/stats")
            res.stats_latencies.append(time.perf_counter() - t)
            if r.status_code != 200:
                res.errors.append(f"/v1/stats: HTTP {r.status_code} {r.text[:200]}")
            await asyncio.sleep(period)


def _run(base: str, seconds: float, drivers) -> LoadResult:
    res = LoadResult()

    async def main():
        until = time.monotonic() + seconds
        poller = asyncio.create_task(poll_stats(base, until, res))
        await asyncio.gather(*[d(until, res) for d in drivers])
        poller.cancel()
        await asyncio.gather(poller, return_exceptions=True)

    asyncio.run(main())
    return res


def run_load(base: str, loops: int, seconds: float, timeout: float = 120, seed: int = 0) -> LoadResult:
    """`loops` client loops send requests for `seconds`; each finishes its last request."""
    return _run(base, seconds, [lambda u, r, i=i: client_loop(base, seed * 1000 + i, u, r, timeout)
                                for i in range(loops)])


def run_arrivals(base: str, rate: float, seconds: float, timeout: float = 120, seed: int = 0) -> LoadResult:
    """Poisson arrivals at `rate` per second for `seconds`; waits for the last to end."""
    return _run(base, seconds, [lambda u, r: arrivals(base, rate, u, r, timeout, seed)])


def canary_ok(res: LoadResult, expected: Optional[str] = None) -> bool:
    """Every canary got one and the same answer (and `expected`, when given)."""
    answers = set(res.canaries)
    return len(answers) <= 1 and (expected is None or answers <= {expected})

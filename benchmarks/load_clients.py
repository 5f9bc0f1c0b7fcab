"""Client loops for load tests: mixed chat and completion requests through the openai
client, streamed and not, prompts of a few words to ~1,500 tokens, and a /v1/stats poller."""

import asyncio
import random
import time
from dataclasses import dataclass, field
from typing import List

import httpx
from openai import AsyncOpenAI

WORDS = ("time person year way day thing man world life hand part child eye woman place work week case point "
         "government company number group problem fact water river mountain city music story garden").split()


@dataclass
class LoadResult:
    latencies: List[float] = field(default_factory=list)  # seconds, per finished request
    errors: List[str] = field(default_factory=list)
    stats_latencies: List[float] = field(default_factory=list)
    output_tokens: int = 0
    refusals: int = 0  # 429 answers (the openai client retries them after Retry-After, twice)


def prompt_words(rng: random.Random) -> str:
    n = int(round(2 ** rng.uniform(1.5, 10.2)))  # 3 .. ~1,200 words (~1,500 tokens), log-uniform
    return " ".join(rng.choice(WORDS) for _ in range(n))


async def one_request(client: AsyncOpenAI, model: str, rng: random.Random, res: LoadResult) -> None:
    text, stream = prompt_words(rng), rng.random() < 0.5
    kw = dict(model=model, max_tokens=rng.randrange(8, 65), temperature=rng.choice([0.0, 0.7]), stream=stream)
    start = time.perf_counter()
    try:
        if rng.random() < 0.5:
            r = await client.chat.completions.create(messages=[{"role": "user", "content": text}], **kw)
        else:
            r = await client.completions.create(prompt=text, **kw)
        if stream:
            n = 0
            async for chunk in r:
                n += bool(chunk.choices)
            assert n > 0, "empty stream"
        else:
            n = r.usage.completion_tokens
        res.output_tokens += n
        res.latencies.append(time.perf_counter() - start)
    except Exception as e:  # noqa: BLE001 - every failure is collected and asserted on
        res.errors.append(f"{type(e).__name__}: {e}")


async def client_loop(base: str, seed: int, until: float, res: LoadResult, timeout: float) -> None:
    rng = random.Random(seed)
    async def count_refusals(response: httpx.Response) -> None:
        res.refusals += response.status_code == 429

    http = httpx.AsyncClient(timeout=timeout, event_hooks={"response": [count_refusals]})
    # The openai client's own retries (2, after Retry-After), as its users have them.
    client = AsyncOpenAI(base_url=f"{base}/v1", api_key="unused", timeout=timeout, http_client=http)
    try:
        model = (await client.models.list()).data[0].id
        while time.monotonic() < until:
            await one_request(client, model, rng, res)
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


def run_load(base: str, loops: int, seconds: float, timeout: float = 120) -> LoadResult:
    """`loops` client loops issue requests for `seconds`; each finishes its last request
    (a request taking over `timeout` seconds fails)."""
    res = LoadResult()

    async def main():
        until = time.monotonic() + seconds
        poller = asyncio.create_task(poll_stats(base, until, res))
        await asyncio.gather(*[client_loop(base, i, until, res, timeout) for i in range(loops)])
        poller.cancel()
        await asyncio.gather(poller, return_exceptions=True)

    asyncio.run(main())
    return res

"""The app as users deploy it (`serve run deploy/app.yaml`: the embedded default model,
the default KV pool, budgets and admission): it answers the openai client; embeddings of
any number of inputs; and, overloaded by more client loops than the box can serve, it
loses nothing it admitted, refuses the rest at once with 429 + Retry-After, never
corrupts an answer, and /v1/stats answers at once throughout."""

import statistics
import sys
from pathlib import Path

import httpx
import numpy as np
import pytest
import yaml
from openai import OpenAI
from serve_fixtures import free_port, serve_run

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from load_clients import canary_ok, run_load  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
# On this 2-core CPU the deployed app completes ~0.3 mixed requests a second; with each
# client waiting 30 s, about 8 fit at a time: 32 loops are four times what it can serve.
LOOPS, SECONDS, CLIENT_TIMEOUT_S = 32, 45, 30


@pytest.fixture(scope="module")
def deployed(tmp_path_factory):
    cfg = yaml.safe_load((ROOT / "deploy" / "app.yaml").read_text())
    port = free_port()
    cfg["http_options"] = {**cfg["http_options"], "host": "127.0.0.1", "port": port}  # nothing else changed
    path = tmp_path_factory.mktemp("deploy") / "app.yaml"
    path.write_text(yaml.safe_dump(cfg))
    with serve_run(path, port, ROOT) as base:
        httpx.get(f"{base}/v1/stats", timeout=60)  # the ingress's first call to a replica method sets up its handle
        yield base


@pytest.fixture(scope="module")
def client(deployed):
    return OpenAI(base_url=f"{deployed}/v1", api_key="unused", timeout=120)


def test_it_answers_the_openai_client(client):
    model = client.models.list().data[0].id
    r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}],
                                       max_tokens=5, temperature=0)
    assert r.choices[0].finish_reason in ("stop", "length") and r.usage.completion_tokens >= 1


@pytest.mark.parametrize("n", [1, 2, 16, 64])
def test_embeddings_of_any_number_of_inputs(client, n):
    """One HTTP request, one replica call, whatever N (strings and token-id arrays); each
    vector equals that input's embedding alone."""
    model = client.models.list().data[0].id
    texts = [f"sentence number {i} about the river and the mountain" for i in range(n)]
    r = client.embeddings.create(model=model, input=texts, encoding_format="float", timeout=60)
    assert [d.index for d in r.data] == list(range(n))
    alone = client.embeddings.create(model=model, input=texts[-1], encoding_format="float", timeout=60)
    assert np.allclose(r.data[-1].embedding, alone.data[0].embedding, atol=1e-4)
    ids = [[100 + i, 200 + i, 300] for i in range(n)]
    t = client.embeddings.create(model=model, input=ids, encoding_format="float", timeout=60)
    assert len(t.data) == n and t.usage.prompt_tokens == 3 * n


def test_overloaded_it_loses_nothing_and_refuses_cleanly(deployed):
    base = deployed
    before = httpx.get(f"{base}/v1/stats", timeout=10).json()["replica"]
    res = run_load(base, LOOPS, SECONDS, timeout=CLIENT_TIMEOUT_S)
    stats = httpx.get(f"{base}/v1/stats", timeout=10).json()["replica"]
    lat, st = sorted(res.latencies), sorted(res.stats_latencies)
    computed = stats["tokens_computed"] - before["tokens_computed"]
    wasted = stats["tokens_wasted"] - before["tokens_wasted"]
    print(f"\n{LOOPS} loops, {CLIENT_TIMEOUT_S:.0f} s client timeout: {len(lat)} completed (latencies "
          f"{[round(x, 1) for x in lat]}), {res.lost} lost {res.errors[:3]}, {res.refused} refused, "
          f"{res.refusals} answers 429, retries after Retry-After taken {res.retries_admitted} / refused again "
          f"{res.retries_refused}; wasted {wasted} of {computed} tokens; /v1/stats p50 "
          f"{1e3 * statistics.median(st):.0f} ms max {1e3 * st[-1]:.0f} ms; engine {stats}")
    assert not res.errors, res.errors[:5]  # nothing admitted was lost, no wrong answer
    assert canary_ok(res), res.canaries
    assert res.refusals > 0  # more than it can serve: some were told at once
    assert len(lat) >= 8 and lat[-1] < CLIENT_TIMEOUT_S
    assert stats["kv_pool_bytes"] > 1 << 30  # the deployed default pool, not a reduced one
    assert stats["running"] == 0 and stats["kv_pages_used"] == 0
    budget = sum(stats[k] for k in ("weights_bytes", "kv_pool_bytes", "decode_staging_budget_bytes",
                                    "activation_budget_bytes"))
    assert stats["peak_memory_bytes"] <= budget, stats
    assert statistics.median(st) < 0.1 and st[int(0.95 * len(st))] < 0.5, f"/v1/stats {[round(x, 3) for x in st]}"

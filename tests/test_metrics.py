"""The replicas' Prometheus metrics, scraped from Ray's metrics endpoint after real requests."""

import re
import time

import httpx
import pytest
from serve_fixtures import ENGINE, free_port, run_app, serving, tiny_model_dir

REQUESTS = 4
SHARED = "You are a helpful assistant who answers briefly. " * 6  # > 2 KV pages: later requests hit the cache
OWN_CLUSTER = True  # Ray's metrics export is a cluster option: run after the modules sharing one (conftest)
SAMPLE = re.compile(r"^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(?P<labels>.*)\})? (?P<value>\S+)", re.M)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    path = str(tiny_model_dir(tmp_path_factory))
    port = free_port()
    with serving(num_cpus=2, _metrics_export_port=port,
                 _system_config={"metrics_report_interval_ms": 1000}) as base:
        run_app(base, "metrics", "/", model=path, model_name="tiny", engine=ENGINE)  # prefix router
        yield base, f"http://127.0.0.1:{port}/metrics"


def scrape(url: str) -> dict:
    """{metric name: summed value over all label sets} of the macfarm metrics."""
    totals: dict = {}
    for m in SAMPLE.finditer(httpx.get(url, timeout=10).text):
        if "macfarm_" in m["name"]:
            totals[m["name"]] = totals.get(m["name"], 0.0) + float(m["value"])
    return totals


def find(totals: dict, stem: str, suffix: str = "") -> float:
    names = [n for n in totals if n.endswith(stem + suffix) or n.endswith(stem + "_total" + suffix)]
    return sum(totals[n] for n in names) if names else -1.0


def test_replica_metrics_are_exported(served):
    base, url = served
    for i in range(REQUESTS):
        body = {"prompt": SHARED + f"Request {i}: tell me something", "max_tokens": 8, "temperature": 0, "ignore_eos": True,
                "stream": i % 2 == 0}
        r = httpx.post(f"{base}/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
    deadline, totals = time.time() + 60, {}
    while time.time() < deadline:
        totals = scrape(url)
        if (find(totals, "macfarm_time_to_first_token_seconds", "_count") >= REQUESTS
                and find(totals, "macfarm_output_tokens") >= REQUESTS * 8
                and find(totals, "macfarm_kv_pages_used_fraction") >= 0
                and find(totals, "macfarm_decode_steps_staged") > 0):
            break
        time.sleep(1)
    assert find(totals, "macfarm_time_to_first_token_seconds", "_count") >= REQUESTS, sorted(totals)
    assert find(totals, "macfarm_time_to_first_token_seconds", "_sum") > 0
    assert find(totals, "macfarm_inter_token_latency_seconds", "_count") > 0
    assert find(totals, "macfarm_request_latency_seconds", "_count") >= REQUESTS
    assert find(totals, "macfarm_prompt_tokens") > 0
    assert find(totals, "macfarm_output_tokens") >= REQUESTS * 8
    assert find(totals, "macfarm_cached_prompt_tokens") > 0
    assert find(totals, "macfarm_requests") >= REQUESTS
    assert find(totals, "macfarm_decode_steps_staged") > 0  # 8-token decodes: staged from their first step
    for gauge in ("macfarm_running_requests", "macfarm_waiting_requests", "macfarm_kv_pages_used_fraction",
                  "macfarm_prefix_cache_hit_rate", "macfarm_host_ms_per_step", "macfarm_host_cpu_ms_per_step",
                  "macfarm_queue_wait_seconds"):
        assert find(totals, gauge) >= 0, (gauge, sorted(totals))
    print({k: v for k, v in sorted(totals.items()) if "bucket" not in k})

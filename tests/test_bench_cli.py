"""The benchmark CLI: `summarize` on synthetic records, and each workload against a real Serve app."""

import json

import pytest
from serve_fixtures import run_app, serving, tiny_model_dir

from serve_app.bench import main, percentile, summarize


def rec(start, ttft, itl, end, out, prompt=100, cached=0, error=None):
    return {"start": start, "ttft": ttft, "itl": itl, "end": end, "output_tokens": out,
            "prompt_tokens": prompt, "cached_tokens": cached, "error": error}


def test_percentile_interpolates_like_numpy():
    xs = list(range(1, 11))  # numpy.percentile: p50 5.5, p90 9.1, p99 9.91
    assert percentile(xs, 50) == pytest.approx(5.5)
    assert percentile(xs, 90) == pytest.approx(9.1)
    assert percentile(xs, 99) == pytest.approx(9.91)
    assert percentile([3.0], 99) == 3.0 and percentile([], 50) is None


def test_summarize_synthetic_records():
    records = [rec(0.0, 0.1, [0.01, 0.02], 1.0, 10, cached=0),
               rec(0.5, 0.2, [0.03], 2.0, 20, cached=50),
               rec(1.0, 0.3, [0.04, 0.05], 4.0, 30, cached=100),
               rec(1.5, None, [], 1.6, 0, cached=0, error="HTTP 429: overloaded")]
    s = summarize(records)
    assert (s["requests"], s["ok"], s["failed"]) == (4, 3, 1)
    assert s["duration_s"] == pytest.approx(4.0)  # first start .. last end, failures included
    assert s["request_throughput"] == pytest.approx(3 / 4)
    assert s["output_throughput"] == pytest.approx(60 / 4)
    assert s["prefix_hit_rate"] == pytest.approx(150 / 300)  # failed request's tokens not counted
    assert s["ttft_s"]["p50"] == pytest.approx(0.2) and s["ttft_s"]["p90"] == pytest.approx(0.28)
    assert s["ttft_s"]["mean"] == pytest.approx(0.2)
    assert s["itl_s"]["p50"] == pytest.approx(0.03) and s["itl_s"]["p99"] == pytest.approx(0.0496)
    assert s["e2e_s"]["p50"] == pytest.approx(1.5) and s["e2e_s"]["p99"] == pytest.approx(2.97)
    assert summarize([])["ok"] == 0 and summarize([])["ttft_s"]["p50"] is None


@pytest.fixture(scope="module")
def base_url(tmp_path_factory):
    path = str(tiny_model_dir(tmp_path_factory))
    with serving() as base:
        run_app(base, "bench", "/", model=path, model_name="tiny", engine={"max_total_tokens": 4096})
        yield f"{base}/v1"


@pytest.mark.parametrize("workload,extra", [
    ("fixed", ["--prompt-tokens", "32"]),
    ("tenants", ["--tenants", "2", "--prefix-tokens", "64"]),
    ("chat", ["--turns", "3", "--prompt-tokens", "16"]),
])
def test_cli_end_to_end(base_url, tmp_path, capsys, workload, extra):
    out, png = tmp_path / "run.json", tmp_path / "run.png"
    rc = main(["--base-url", base_url, "--workload", workload, "--num-requests", "12", "--concurrency", "4",
               "--output-tokens", "8", "--seed", "1", "--out", str(out), "--plot", str(png), *extra])
    assert rc == 0
    assert "TTFT" in capsys.readouterr().out
    res = json.loads(out.read_text())
    assert set(res) == {"config", "summary", "records"} and res["config"]["workload"] == workload
    s = res["summary"]
    assert {"ttft_s", "itl_s", "e2e_s", "request_throughput", "output_throughput", "prefix_hit_rate"} <= set(s)
    assert s["requests"] == s["ok"] == 12 and s["failed"] == 0
    for r in res["records"]:
        assert r["error"] is None and r["status"] == 200 and r["ttft"] > 0 and r["output_tokens"] == 8
        assert r["end"] > r["start"] and len(r["itl"]) >= 1
    if workload == "fixed":
        assert all(r["prompt_tokens"] == 32 for r in res["records"])
    else:  # shared system prompts / conversation history hit the prefix cache
        assert s["prefix_hit_rate"] > 0
    assert png.stat().st_size > 0

"""Through Serve with the openai client: an app with `prefix_cache_dir` is deleted and
deployed again (a restart: new replicas, empty memory), and a long prompt sent before it
comes back from the SSD tier: `cached_tokens` in the streamed usage chunk, the same
answer as before."""

import time

import httpx
import pytest
from openai import OpenAI
from ray import serve
from serve_fixtures import ENGINE, run_app, serving, tiny_model_dir

PROMPT = "You are a coding agent. Here are the tools and the history so far. " * 12


@pytest.fixture(scope="module")
def cluster():
    with serving() as base:
        yield base


def deploy(base, path, directory):
    run_app(base, "diskcache", "/diskcache", model=path, model_name="tiny",
            engine={**ENGINE, "prefix_cache_dir": str(directory)})
    return OpenAI(base_url=f"{base}/diskcache/v1", api_key="unused", timeout=60)


def ask(client):
    chunks = list(client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": PROMPT}], max_tokens=6, temperature=0,
        stream=True, stream_options={"include_usage": True}))
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices), chunks[-1].usage


def test_a_prompt_from_before_a_restart_comes_back_from_the_ssd(cluster, tmp_path_factory):
    path = str(tiny_model_dir(tmp_path_factory))
    directory = tmp_path_factory.mktemp("kv")
    client = deploy(cluster, path, directory)
    text, usage = ask(client)
    assert usage.prompt_tokens > 160 and usage.prompt_tokens_details.cached_tokens == 0
    pages = (usage.prompt_tokens - 1) // 16
    deadline = time.time() + 30
    while disk_stats(cluster)["pages_written"] < pages:  # on disk soon, not at shutdown
        assert time.time() < deadline
        time.sleep(0.2)
    serve.delete("diskcache")
    client = deploy(cluster, path, directory)
    again, usage2 = ask(client)
    assert again == text
    assert usage2.prompt_tokens_details.cached_tokens == (usage.prompt_tokens - 1) // 16 * 16
    assert disk_stats(cluster)["hit_tokens"] == usage2.prompt_tokens_details.cached_tokens


def disk_stats(base):
    return httpx.get(f"{base}/diskcache/v1/stats", timeout=10).json()["replica"]["prefix_cache_disk"]

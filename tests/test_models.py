"""Several models and LoRA adapters in one app, on a simulated Mac (ray.cluster_utils.Cluster,
one node with {"mac": 1, "mac_memory_gb": 1}): requests routed by `model` (a model, an
adapter, or base:adapter) and answered token for token as mlx-lm answers them; 404s in
each API's error shape; models placed by the memory they declare (the small ones share
the Mac, the two big ones cannot both fit); a model loaded on its first request and
unloaded when idle; the least recently used idle model unloaded to make room for
another, never while it streams; a deployment that cannot fit refused at build."""

import asyncio
import functools
import json
import os
import time

import anthropic
import httpx
import openai
import pytest
import ray
from conftest import reference_greedy
from mlx_lm import load as mlx_load
from ray import serve
from ray.cluster_utils import Cluster
from ray.util.state import list_actors
from serve_fixtures import ENGINE, free_port, run_app, stop_farm, stop_serve
from tiny_models import mlx_adapter_as_peft, save_tiny_adapter, save_tiny_model

from mlx_worker.memory.paging import adapter_root
from mlx_worker.models.gguf import default_model_path
from serve_app.app import build_app

BIG_TOKENS = 650_000  # KV pool of each big model: ~0.55 GiB declared with its weights; two do not fit 1 GiB
MSGS = [{"role": "user", "content": "Name a colour."}]


@pytest.fixture(scope="module")
def farm(tmp_path_factory):
    root = tmp_path_factory.mktemp("team")
    tok_dir = default_model_path()
    paths = {"coder": save_tiny_model("llama", root / "coder", tok_dir),
             "small": save_tiny_model("qwen3", root / "small", tok_dir),
             "big": save_tiny_model("llama", root / "big", tok_dir, seed=5)}
    sql = save_tiny_adapter(paths["coder"], root / "sql", ["self_attn.q_proj", "self_attn.v_proj"], seed=1)
    acme_mlx = save_tiny_adapter(paths["coder"], root / "acme-mlx", ["self_attn.o_proj", "mlp.up_proj"], seed=2)
    acme = mlx_adapter_as_peft(acme_mlx, root / "acme", ["o_proj", "up_proj"])
    stop_serve()  # the local cluster earlier modules shared: this one is the farm
    # Scale-from-zero and the unload signal travel on Serve's autoscaling metrics (10 s by default).
    os.environ.update(RAY_SERVE_HANDLE_AUTOSCALING_METRIC_PUSH_INTERVAL_S="0.5",
                      RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S="0.5")
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2})
    cluster.add_node(num_cpus=4, resources={"mac": 1, "mac_memory_gb": 1})
    try:
        ray.init(address=cluster.address)
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        base = f"http://127.0.0.1:{port}"
        big = {"model": str(paths["big"]), "min_replicas": 0, "engine": {"max_total_tokens": BIG_TOKENS}}
        run_app(base, "team", "/", engine=ENGINE, models=[
            {"name": "coder", "model": str(paths["coder"]), "adapters": {"coder-sql": str(sql), "coder-acme": str(acme)}},
            {"name": "small", "model": str(paths["small"]), "min_replicas": 0, "idle_unload_s": 2},
            {"name": "big", **big},
            {"name": "big2", **big},
        ])
        yield base, paths, {"coder-sql": sql, "coder-acme": acme_mlx}
    finally:
        for k in ("RAY_SERVE_HANDLE_AUTOSCALING_METRIC_PUSH_INTERVAL_S",
                  "RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S"):
            os.environ.pop(k, None)
        stop_farm(cluster)


@pytest.fixture(scope="module")
def client(farm):
    return openai.OpenAI(base_url=f"{farm[0]}/v1", api_key="none", max_retries=0, timeout=120)


def _listing(base):
    return {m["id"]: m for m in httpx.get(f"{base}/v1/models", timeout=30).json()["data"]}


def _wait_loaded(base, model, want, timeout=90):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if _listing(base)[model]["loaded"] is want:
            return
        time.sleep(0.5)
    raise AssertionError(f"{model} loaded never became {want}: {_listing(base)[model]}")


@functools.lru_cache(maxsize=None)
def _mlx(path, adapter):
    return mlx_load(str(path), adapter_path=None if adapter is None else str(adapter))


def _greedy(path, messages_or_ids, n, adapter=None):
    model, tok = _mlx(path, adapter)
    ids = messages_or_ids if isinstance(messages_or_ids[0], int) else \
        tok.apply_chat_template(messages_or_ids, add_generation_prompt=True)
    return tok.decode(reference_greedy(model, ids, n), skip_special_tokens=True)


def test_every_model_and_adapter_is_listed_with_its_base(farm):
    base = farm[0]
    _wait_loaded(base, "small", False)  # min_replicas 0: not yet
    models = _listing(base)
    assert list(models) == ["coder", "coder-sql", "coder-acme", "small", "big", "big2"]
    assert models["coder-sql"]["parent"] == models["coder-acme"]["parent"] == "coder"
    assert models["coder"]["parent"] is None
    assert models["coder"]["loaded"] is True and models["big"]["loaded"] is False


def test_requests_go_to_the_model_they_name_and_answer_as_mlx_lm(farm, client):
    base, paths, adapters = farm
    for name in ("coder", "small"):
        r = client.chat.completions.create(model=name, messages=MSGS, max_tokens=10, temperature=0)
        assert r.model == name
        assert r.choices[0].message.content == _greedy(paths[name], MSGS, 10)
    prompt = list(range(200, 260))
    for sent, adapter in (("coder-sql", "coder-sql"), ("coder:coder-acme", "coder-acme"), ("coder", None)):
        r = client.completions.create(model=sent, prompt=prompt, max_tokens=10, temperature=0)
        assert r.model == sent
        # coder-acme is served from PEFT's format; mlx-lm loads the same weights in its own
        assert r.choices[0].text == _greedy(paths["coder"], prompt, 10, adapters.get(adapter)), sent


def test_a_replica_reports_its_resident_adapters_to_the_router(farm):
    """The root of each resident adapter's hash chain is among the pages a replica reports,
    and leads the hashes the ingress sends: a prompt no replica has cached still goes to
    one that has its adapter loaded."""
    stats = serve.get_deployment_handle("MLXReplica_coder", "team").options(
        method_name="record_routing_stats").remote().result()
    assert {adapter_root("coder-sql"), adapter_root("coder-acme")} <= set(stats["cached_page_hashes"])


def test_the_base_and_two_adapters_stream_together(farm):
    """Concurrent streams for the base and both adapters: one batch on one replica."""
    base, paths, adapters = farm
    prompt = list(range(300, 340))
    names = ["coder", "coder-sql", "coder-acme"] * 3
    refs = {n: _greedy(paths["coder"], prompt, 12, adapters.get(n)) for n in set(names)}

    async def one(ac, name):
        text = ""
        async with ac.stream("POST", f"{base}/v1/completions", json={
                "model": name, "prompt": prompt, "max_tokens": 12, "temperature": 0, "stream": True}) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    text += "".join(c["text"] for c in json.loads(line[6:])["choices"])
        return text

    async def main():
        async with httpx.AsyncClient(timeout=120) as ac:
            return await asyncio.gather(*[one(ac, n) for n in names])

    assert asyncio.run(main()) == [refs[n] for n in names]


@pytest.mark.parametrize("name, says", [
    ("gpt-9", "does not exist"), ("coder:nope", "has no adapter 'nope'"),
    ("small:coder-sql", "it is an adapter of 'coder'")])
def test_unknown_models_and_adapters_are_404_in_each_apis_shape(farm, name, says):
    base = farm[0]
    r = httpx.post(f"{base}/v1/chat/completions", json={"model": name, "messages": MSGS}, timeout=30)
    assert r.status_code == 404 and says in r.json()["error"]["message"] and r.json()["error"]["code"] == "model_not_found"
    r = httpx.post(f"{base}/v1/responses", json={"model": name, "input": "hi"}, timeout=30)
    assert r.status_code == 404 and says in r.json()["error"]["message"]
    r = httpx.post(f"{base}/v1/embeddings", json={"model": name, "input": "hi"}, timeout=30)
    assert r.status_code == 404
    with pytest.raises(anthropic.NotFoundError) as e:
        anthropic.Anthropic(base_url=base, api_key="none", max_retries=0).messages.create(
            model=name, max_tokens=4, messages=MSGS)
    assert e.value.body["type"] == "error" and says in e.value.body["error"]["message"]


def test_all_five_apis_on_a_model_loaded_on_demand(farm, client):
    base = farm[0]
    r = client.chat.completions.create(model="small", messages=MSGS, max_tokens=4)
    assert r.model == "small" and r.usage.completion_tokens >= 1
    assert client.completions.create(model="small", prompt="Once", max_tokens=4).model == "small"
    assert client.responses.create(model="small", input="hi", max_output_tokens=4).model == "small"
    assert len(client.embeddings.create(model="small", input=["a", "b"]).data) == 2
    m = anthropic.Anthropic(base_url=base, api_key="none", max_retries=0).messages.create(
        model="small", max_tokens=4, messages=MSGS)
    assert m.model == "small" and m.usage.output_tokens >= 1
    assert _listing(base)["small"]["loaded"] is True


def test_small_models_share_the_mac_each_big_one_needs_most_of_it(farm):
    on = {a.class_name.split(":")[-1]: a.node_id for a in list_actors(filters=[("state", "=", "ALIVE")])
          if "team:MLXReplica" in a.class_name}
    mac = next(n["NodeID"] for n in ray.nodes() if n["Alive"] and n["Resources"].get("mac"))
    assert on.get("MLXReplica_coder") == on.get("MLXReplica_small") == mac
    with pytest.raises(ValueError, match="does not fit the farm"):
        build_app({"models": [{"name": "huge", "model": str(farm[1]["big"]), "engine": {"max_total_tokens": 2_000_000}}]})


def test_a_model_makes_room_by_unloading_the_idle_one_never_a_streaming_one(farm):
    """big streams (2 samples of 300 tokens) while big2, which cannot fit beside it, is
    asked for: big2 waits, big's stream completes whole, then big is unloaded and big2
    loads and answers."""
    base = farm[0]
    events = {}

    async def stream_big(ac):
        usage = None
        async with ac.stream("POST", f"{base}/v1/completions", json={
                "model": "big", "prompt": "Once upon a time", "max_tokens": 300, "n": 2, "ignore_eos": True,
                "temperature": 0.8, "stream": True, "stream_options": {"include_usage": True}}) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    events.setdefault("big_first", time.time())
                    chunk = json.loads(line[6:])
                    usage = chunk.get("usage") or usage
                elif line == "data: [DONE]":
                    events["big_done"] = time.time()
        return usage

    async def ask_big2(ac):
        while "big_first" not in events:
            await asyncio.sleep(0.05)
        events["big2_asked"] = time.time()
        r = await ac.post(f"{base}/v1/completions", json={"model": "big2", "prompt": "Hi", "max_tokens": 4})
        events["big2_answered"] = time.time()
        return r

    async def main():
        async with httpx.AsyncClient(timeout=180) as ac:
            return await asyncio.gather(stream_big(ac), ask_big2(ac))

    usage, r2 = asyncio.run(main())
    assert usage and usage["completion_tokens"] == 2 * 300  # the stream was never cut
    assert r2.status_code == 200 and r2.json()["model"] == "big2"
    assert events["big2_asked"] < events["big_done"] < events["big2_answered"]  # it could only load once big was idle
    _wait_loaded(base, "big", False)
    _wait_loaded(base, "big2", True)


def test_an_idle_model_unloads_then_loads_again_on_its_next_request(farm, client):
    base = farm[0]
    _wait_loaded(base, "small", False, timeout=60)  # idle_unload_s 2, over Serve's 12 s window
    r = httpx.post(f"{base}/v1/chat/completions", json={"model": "small", "messages": MSGS, "max_tokens": 4},
                   headers={"X-Request-Timeout": "0.3"}, timeout=30)
    assert r.status_code == 503 and int(r.headers["retry-after"]) >= 1  # loading: not within 0.3 s
    assert r.json()["error"]["code"] == "model_loading"
    r = client.chat.completions.create(model="small", messages=MSGS, max_tokens=4)  # waits for it
    assert r.choices[0].message.content

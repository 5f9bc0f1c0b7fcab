"""A simulated Mac farm (ray.cluster_utils.Cluster, 3 nodes with {"mac": 1}): one
replica per Mac, and the prefix-affinity router sends a tenant to the replica that
cached its system prompt.

Beside it, a replica spanning two more Macs ({"bigmac": 1} nodes, the app's
`replica_resource`) with `tensor_parallel_size: 2`: rank 0 (the Serve replica) and rank 1
(an actor) on different Macs run the model's all-reduces over MLX's `ring` on loopback.
Its answers equal an ordinary replica's; when rank 1 dies, its streams end with an SSE
error and Serve restarts the whole group, which then serves again. Last, one app with
replicas of two sizes (`replica_groups`): the same two Macs serve a
`pipeline_parallel_size: 2` replica of qwen2 (a layer each) beside a one-process replica;
requests reach both, and every answer equals mlx-lm's."""

import concurrent.futures as futures
import random
import time

import httpx
import pytest
import ray
from ray import serve
from ray.cluster_utils import Cluster
from ray.util.state import list_actors
from serve_fixtures import ENGINE, free_port, run_app, stop_farm, stop_serve, tiny_model_dir

MACS = 3


@pytest.fixture(scope="module")
def farm(tmp_path_factory):
    path = str(tiny_model_dir(tmp_path_factory))
    stop_serve()  # the local cluster earlier modules shared: this one is the farm
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2})
    for _ in range(MACS):
        cluster.add_node(num_cpus=1, resources={"mac": 1})
    for _ in range(2):
        cluster.add_node(num_cpus=1, resources={"bigmac": 1})
    try:
        ray.init(address=cluster.address)
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        base = f"http://127.0.0.1:{port}"
        run_app(base, "farm", "/", model=path, model_name="tiny", engine=ENGINE)  # num_replicas: auto
        run_app(base, "tp", "/tp", model=path, model_name="tiny", replica_resource="bigmac",  # auto: 2 / 2 ranks
                engine={**ENGINE, "max_batched_tokens": 64, "tensor_parallel_size": 2})  # a long prompt is chunked
        yield base
    finally:
        stop_farm(cluster)


def test_one_replica_per_mac(farm):
    replicas = [a for a in list_actors(filters=[("state", "=", "ALIVE")]) if "farm:MLXReplica" in a.class_name]
    mac_nodes = {n["NodeID"] for n in ray.nodes() if n["Alive"] and n["Resources"].get("mac")}
    assert len(replicas) == MACS
    assert {a.node_id for a in replicas} == mac_nodes


def test_tenants_follow_their_cached_system_prompt(farm):
    rng = random.Random(0)
    words = "alpha beta gamma delta omega river stone cloud maple ember quartz lumen".split()
    systems = [" ".join(rng.choice(words) for _ in range(300)) for _ in range(MACS)]

    def ask(t, q):
        body = {"messages": [{"role": "system", "content": systems[t]}, {"role": "user", "content": q}],
                "max_tokens": 2, "temperature": 0}
        r = httpx.post(f"{farm}/v1/chat/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        u = r.json()["usage"]
        return u["prompt_tokens"], u["prompt_tokens_details"]["cached_tokens"]

    for t in range(MACS):
        prompt, cached = ask(t, "hello")
        assert cached == 0  # cold everywhere
    hits = [ask(t, f"question {i}") for i in range(4) for t in range(MACS)]
    # The system prompt is most of the prompt; a hit reuses all its whole pages.
    good = [cached >= prompt - 48 for prompt, cached in hits]
    assert sum(good) >= len(hits) - 1, hits


# --- one replica over two Macs (tensor parallel) -------------------------------------------
WORDS = "alpha beta gamma delta omega river stone cloud maple ember quartz lumen".split()


def complete(base, prompt, **kw):
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 12, "temperature": 0, **kw}
    return httpx.post(f"{base}/v1/completions", json=body, timeout=120)


def prompts():
    rng = random.Random(0)
    shared = " ".join(rng.choice(WORDS) for _ in range(300))
    short = [" ".join(rng.choice(WORDS) for _ in range(rng.randrange(2, 40))) for _ in range(5)]
    return short + [shared + " first", shared + " second"]


def answers(base, ps):
    with futures.ThreadPoolExecutor(len(ps)) as pool:  # all at once: one batch
        rs = list(pool.map(lambda p: complete(base, p), ps))
    assert all(r.status_code == 200 for r in rs), [r.text for r in rs]
    return [r.json()["choices"][0]["text"] for r in rs]


def test_the_group_spans_two_macs(farm):
    actors = [a for a in list_actors(filters=[("state", "=", "ALIVE")])
              if "MLXReplica" in a.class_name or "_Rank" in a.class_name]
    bigmacs = {n["NodeID"] for n in ray.nodes() if n["Alive"] and n["Resources"].get("bigmac")}
    group = [a for a in actors if a.node_id in bigmacs]
    assert len(group) == 2 and {a.node_id for a in group} == bigmacs
    stats = httpx.get(f"{farm}/tp/v1/stats", timeout=30).json()["replica"]
    assert stats["ranks"] == 2  # one replica (what the router sees) for the group


def test_tensor_parallel_answers_equal_one_mac(farm):
    ps = prompts()
    tp = answers(f"{farm}/tp", ps)
    assert tp == answers(farm, ps)
    again = complete(f"{farm}/tp", ps[-1]).json()  # the shared prompt is cached now
    assert again["choices"][0]["text"] == tp[-1]
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


def test_a_dead_rank_ends_its_streams_with_an_error_then_the_group_serves_again(farm):
    ps = prompts()[:2]
    expected = answers(farm, ps)
    rank1 = [a for a in list_actors(filters=[("state", "=", "ALIVE")]) if "_Rank" in a.class_name]
    assert len(rank1) == 1
    body = {"model": "tiny", "prompt": ps[0], "max_tokens": 900, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{farm}/tp/v1/completions", json=body, timeout=120) as r:
        events = (line[6:] for line in r.iter_lines() if line.startswith("data: "))
        next(events)  # decoding
        ray.kill(ray.get_actor(rank1[0].name, namespace=rank1[0].ray_namespace))
        rest = list(events)
    assert rest and '"replica_failed"' in rest[-1], rest[-2:]  # an SSE error event, no [DONE]
    statuses = set()
    deadline = time.time() + 180
    while time.time() < deadline:  # Serve restarts the replica, and the group with it
        r = complete(f"{farm}/tp", ps[0])
        statuses.add(r.status_code)
        if r.status_code == 200:
            break
        time.sleep(1)
    assert statuses <= {200, 503} and 200 in statuses, statuses
    assert answers(f"{farm}/tp", ps) == expected


def test_replicas_of_two_sizes_in_one_app_equal_mlx_lm(farm, tmp_path_factory):
    """Last: the two bigmacs go to a pipeline-parallel replica of a model with
    `model.pipeline` (each Mac holds one of qwen2's two layers), in one app with an
    ordinary replica beside it; the ingress spreads new prompts over both groups."""
    from mlx_lm import load
    from conftest import reference_greedy

    serve.delete("tp")
    path = tiny_model_dir(tmp_path_factory, arch="qwen2")
    groups = [{"name": "pair", "replica_resource": "bigmac", "engine": {"pipeline_parallel_size": 2}},
              {"name": "one", "replica_resource": None, "num_replicas": 1}]
    run_app(farm, "pp", "/pp", model=str(path), model_name="tiny", replica_groups=groups,
            engine={**ENGINE, "max_batched_tokens": 64})
    model, tokenizer = load(str(path))
    rng = random.Random(1)
    ids = [[rng.randrange(100, 40000) for _ in range(n)] for n in (5, 30, 150, 9)]  # 150: chunked
    with futures.ThreadPoolExecutor(len(ids)) as pool:
        rs = list(pool.map(lambda p: complete(f"{farm}/pp", p, ignore_eos=True), ids))
    for p, r in zip(ids, rs):
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == tokenizer.decode(reference_greedy(model, p, 12))
    stats = httpx.get(f"{farm}/pp/v1/stats", timeout=30).json()
    pair, one = stats["groups"]["MLXReplica_pair"], stats["groups"]["MLXReplica_one"]
    assert (pair["ranks"], one["ranks"]) == (2, 1)
    assert pair["steps"] > 0 and one["steps"] > 0  # both groups served
    assert stats["in_flight"] == {"MLXReplica_pair": 0, "MLXReplica_one": 0}

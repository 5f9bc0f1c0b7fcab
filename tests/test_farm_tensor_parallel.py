"""One replica spanning two simulated Macs (ray.cluster_utils.Cluster nodes with
{"mac": 1}): `tensor_parallel_size: 2` places rank 0 (the Serve replica) and rank 1 (an
actor) on different Macs, which run the model's all-reduces over MLX's `ring` on
loopback. Its answers equal an ordinary one-Mac replica's; when rank 1 dies, requests get
an SSE error event (or a 503) and Serve restarts the whole group, which then serves again."""

import concurrent.futures as futures
import random
import time

import httpx
import pytest
import ray
from ray import serve
from ray.cluster_utils import Cluster
from ray.util.state import list_actors
from serve_fixtures import ENGINE, free_port, run_app, stop_farm, tiny_model_dir

SMALL_STEPS = {**ENGINE, "max_batched_tokens": 64}  # a 300-word prompt is prefilled in chunks
WORDS = "alpha beta gamma delta omega river stone cloud maple ember quartz lumen".split()


@pytest.fixture(scope="module")
def farm(tmp_path_factory):
    path = str(tiny_model_dir(tmp_path_factory))
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2})
    for _ in range(2):
        cluster.add_node(num_cpus=1, resources={"mac": 1})
    try:
        ray.init(address=cluster.address)
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        base = f"http://127.0.0.1:{port}"
        run_app(base, "tp", "/tp", model=path, model_name="tiny",  # num_replicas auto: 2 Macs / 2 ranks
                engine={**SMALL_STEPS, "tensor_parallel_size": 2})
        run_app(base, "one", "/one", model=path, model_name="tiny", replica_resource=None, num_replicas=1,
                engine=SMALL_STEPS)
        yield base
    finally:
        stop_farm(cluster)


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
    return [r.json() for r in rs]


def test_the_group_spans_two_macs(farm):
    actors = [a for a in list_actors(filters=[("state", "=", "ALIVE")])
              if "MLXReplica" in a.class_name or "_Rank" in a.class_name]
    macs = {n["NodeID"] for n in ray.nodes() if n["Alive"] and n["Resources"].get("mac")}
    group = [a for a in actors if a.node_id in macs]
    assert len(group) == 2 and {a.node_id for a in group} == macs
    stats = httpx.get(f"{farm}/tp/v1/stats", timeout=30).json()["replica"]
    assert stats["ranks"] == 2  # one replica (what the router sees) for the group


def test_tensor_parallel_answers_equal_one_mac(farm):
    ps = prompts()
    tp, one = answers(f"{farm}/tp", ps), answers(f"{farm}/one", ps)
    assert [r["choices"][0]["text"] for r in tp] == [r["choices"][0]["text"] for r in one]
    again = complete(f"{farm}/tp", ps[-1]).json()  # the shared prompt is cached now
    assert again["choices"][0]["text"] == tp[-1]["choices"][0]["text"]
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


def test_a_dead_rank_ends_its_streams_with_an_error_then_the_group_serves_again(farm):
    ps = prompts()
    expected = [r["choices"][0]["text"] for r in answers(f"{farm}/one", ps[:2])]
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
        time.sleep(2)
    assert statuses <= {200, 503} and 200 in statuses, statuses
    assert [r["choices"][0]["text"] for r in answers(f"{farm}/tp", ps[:2])] == expected

"""A simulated Mac farm (ray.cluster_utils.Cluster, 3 nodes with {"mac": 1}): one
replica per Mac, and the prefix-affinity router sends a tenant to the replica that
cached its system prompt."""

import random

import httpx
import pytest
import ray
from ray import serve
from ray.cluster_utils import Cluster
from ray.util.state import list_actors
from serve_fixtures import ENGINE, free_port, run_app, stop_farm, tiny_model_dir

MACS = 3


@pytest.fixture(scope="module")
def farm(tmp_path_factory):
    path = str(tiny_model_dir(tmp_path_factory))
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2})
    for _ in range(MACS):
        cluster.add_node(num_cpus=1, resources={"mac": 1})
    try:
        ray.init(address=cluster.address)
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        base = f"http://127.0.0.1:{port}"
        run_app(base, "farm", "/", model=path, model_name="tiny", engine=ENGINE)  # num_replicas: auto
        yield base
    finally:
        stop_farm(cluster)


def test_one_replica_per_mac(farm):
    replicas = [a for a in list_actors(filters=[("state", "=", "ALIVE")]) if "MLXReplica" in a.class_name]
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

"""Farm operations on a simulated Mac farm (ray.cluster_utils.Cluster, nodes with
{"mac": 1}): scale-out to a new Mac, a replica killed under load, a bounded soak,
graceful drain when the app is deleted, KV-pool exhaustion under load.

One cluster for the module (CI has 2 cores); the tests run in file order and each
deploys what it needs (`Farm.deploy` skips a redeploy of the same arguments).
"""

import asyncio
import json
import os
import signal
import time

import httpx
import pytest
import ray
import psutil  # noqa: I001  (after ray: Ray ships psutil in ray/thirdparty_files and puts it on the path)
from conftest import reference_greedy
from mlx_lm import load as mlx_load
from ray import serve
from ray.cluster_utils import Cluster
from ray.util.state import list_actors
from serve_fixtures import ENGINE, free_port, run_app, stop_farm, stop_serve, tiny_model_dir

APP = "farm"


class Farm:
    def __init__(self, cluster: Cluster, base: str, model_path: str):
        self.cluster, self.base, self.path = cluster, base, model_path
        self.args = None  # arguments of the deployed app, None when there is none

    def mac_nodes(self) -> set:
        return {n["NodeID"] for n in ray.nodes() if n["Alive"] and n["Resources"].get("mac")}

    def add_mac(self) -> str:
        node = self.cluster.add_node(num_cpus=1, resources={"mac": 1})
        self.cluster.wait_for_nodes()
        deadline = time.time() + 30
        while node.node_id not in self.mac_nodes():
            assert time.time() < deadline, "the new Mac did not join"
            time.sleep(0.2)
        return node.node_id

    def ensure_macs(self, n: int) -> None:
        while len(self.mac_nodes()) < n:
            self.add_mac()

    def deploy(self, **args) -> None:
        args = {"model": self.path, "model_name": "tiny", "engine": ENGINE, **args}
        if args != self.args:
            run_app(self.base, APP, "/", **args)  # serve.run waits for every replica
            self.args = args

    def delete(self) -> None:
        serve.delete(APP)
        self.args = None

    def replicas(self) -> list:
        return [a for a in list_actors(filters=[("state", "=", "ALIVE")], limit=10_000)
                if a.class_name and "MLXReplica" in a.class_name and APP in a.class_name]

    def wait_replicas(self, n: int, timeout: float, exclude=()) -> list:
        deadline = time.time() + timeout
        while True:
            reps = [a for a in self.replicas() if a.actor_id not in exclude]
            if len(reps) == n:
                return reps
            assert time.time() < deadline, f"{len(reps)} replicas, expected {n}"
            time.sleep(0.5)

    def wait_running(self, n: int, timeout: float) -> None:
        """Until Serve reports n RUNNING replicas (an ALIVE actor may still be loading)."""
        deadline = time.time() + timeout
        while True:
            app = serve.status().applications.get(APP)
            dep = app.deployments.get("MLXReplica") if app else None
            states = dict(dep.replica_states) if dep else {}
            if states.get("RUNNING") == n and sum(states.values()) == n:
                return
            assert time.time() < deadline, f"replica states {states}, expected {n} RUNNING"
            time.sleep(0.5)

    def replica_stats(self, want: int, timeout: float = 30) -> dict:
        """{engine_id: stats} from calls through Serve's router until `want` replicas answered."""
        h = serve.get_deployment_handle("MLXReplica", app_name=APP).options(method_name="stats")
        seen, deadline = {}, time.time() + timeout
        while len(seen) < want and time.time() < deadline:
            st = h.remote().result(timeout_s=30)
            seen[st["engine_id"]] = st
            time.sleep(0.02)
        return seen


@pytest.fixture(scope="module")
def farm(tmp_path_factory):
    path = str(tiny_model_dir(tmp_path_factory))
    stop_serve()  # the local cluster earlier modules shared: this one is the farm
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2})
    cluster.add_node(num_cpus=1, resources={"mac": 1})  # the farm starts with one Mac
    cluster.wait_for_nodes()
    try:
        ray.init(address=cluster.address)  # this cluster only
        port = free_port()
        # All "Macs" share this machine's loopback: one proxy, on the head.
        serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": port})
        yield Farm(cluster, f"http://127.0.0.1:{port}", path)
    finally:
        stop_farm(cluster)


@pytest.fixture(scope="module")
def model(farm):
    m, tok = mlx_load(farm.path)
    return m, tok


# --- HTTP helpers ----------------------------------------------------------------------
async def stream(ac: httpx.AsyncClient, base: str, body: dict, progress: list = None) -> dict:
    """One streamed completion, recorded whatever happens: status, text, number of
    chunks, whether `[DONE]` came, the error (SSE error event, HTTP status or
    transport) and when the stream ended. `progress` gets a timestamp per chunk."""
    r = {"status": None, "text": "", "chunks": 0, "done": False, "error": None, "usage": None, "end": None}
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    try:
        async with ac.stream("POST", f"{base}/v1/completions", json=body) as resp:
            r["status"] = resp.status_code
            if resp.status_code != 200:
                r["error"] = f"HTTP {resp.status_code}: {(await resp.aread())[:300]!r}"
                return r
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    r["done"] = True
                    continue
                msg = json.loads(line[6:])
                if "error" in msg:
                    r["error"] = f"event: {msg['error']}"
                    continue
                if msg.get("usage"):
                    r["usage"] = msg["usage"]
                for c in msg.get("choices", []):
                    r["text"] += c["text"]
                r["chunks"] += 1
                if progress is not None:
                    progress.append(time.monotonic())
    except httpx.HTTPError as e:
        r["error"] = f"transport: {type(e).__name__}: {e}"
    finally:
        r["end"] = time.monotonic()
    return r


async def post(ac: httpx.AsyncClient, base: str, body: dict) -> dict:
    """One non-streamed completion: status, body (JSON or text) or transport error, end time."""
    r = {"status": None, "body": None, "error": None, "end": None}
    try:
        resp = await ac.post(f"{base}/v1/completions", json=body)
        r["status"] = resp.status_code
        try:
            r["body"] = resp.json()
        except ValueError:
            r["body"] = resp.text[:300]
    except httpx.HTTPError as e:
        r["error"] = f"transport: {type(e).__name__}: {e}"
    finally:
        r["end"] = time.monotonic()
    return r


def visible(text: str) -> str:
    """A greedy reference as the server streams it: the engine's detokenizer holds back a
    trailing partial UTF-8 character (U+FFFD) and drops it if max_tokens ends the stream
    there, where a plain decode of all the tokens shows U+FFFD."""
    return text.rstrip("\ufffd")


def complete(base: str, body: dict, timeout: float = 60) -> httpx.Response:
    return httpx.post(f"{base}/v1/completions", json=body, timeout=timeout)


def complete_fully(r: dict, max_tokens: int) -> bool:
    return r["done"] and r["error"] is None and r["usage"] is not None and r["usage"]["completion_tokens"] == max_tokens


# --- 1. scale out to a new Mac ----------------------------------------------------------
def test_scale_out_to_a_new_mac(farm):
    assert len(farm.mac_nodes()) == 1, "runs first, on the one-Mac farm"
    farm.deploy()  # num_replicas: auto -> one per Mac
    (first,) = farm.wait_replicas(1, 10)
    assert first.node_id in farm.mac_nodes()

    new_node = farm.add_mac()
    # `auto` was evaluated at build time: stating the count (changed args) redeploys.
    farm.deploy(num_replicas=2)
    reps = farm.wait_replicas(2, 60)
    assert {a.node_id for a in reps} == farm.mac_nodes()
    assert new_node in {a.node_id for a in reps}
    print(f"\nscale-out: replica on the first Mac {'kept' if first.actor_id in {a.actor_id for a in reps} else 'replaced'}")

    before = farm.replica_stats(2)
    assert len(before) == 2, before

    async def burst():
        async with httpx.AsyncClient(timeout=120) as ac:
            bodies = [{"prompt": f"Tenant {i} system prompt: " + f"rule {i} applies. " * 40 + "Question?",
                       "max_tokens": 16, "temperature": 0, "ignore_eos": True} for i in range(8)]
            return await asyncio.gather(*[stream(ac, farm.base, b) for b in bodies])

    for r in asyncio.run(burst()):
        assert complete_fully(r, 16), r
    after = farm.replica_stats(2)
    assert after.keys() == before.keys()
    served = {e: after[e]["prefix_query_tokens"] - before[e]["prefix_query_tokens"] for e in after}
    assert all(v > 0 for v in served.values()), served  # both replicas took part of the burst


# --- 2. a replica dies under load -------------------------------------------------------
def test_replica_killed_under_load(farm):
    """SIGKILL one replica's process mid-stream. Its streams end at once with a transport
    error (the ingress's SSE generator raises ActorDiedError; the response is closed
    with an OpenAI-style error event and no [DONE], so clients never see a clean but
    short stream); its non-streamed requests get a 503 JSON error. New requests go to the survivor,
    Serve starts a replacement on the freed Mac, and routing carries on."""
    farm.ensure_macs(2)
    farm.deploy(num_replicas=2)
    reps = farm.wait_replicas(2, 60)
    system = "You are the farm's assistant. " * 12
    probe = {"prompt": system + "Probe question", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    r = complete(farm.base, probe)
    assert r.status_code == 200, r.text
    probe_text = r.json()["choices"][0]["text"]  # its prefix is now cached on one replica
    engines = set(farm.replica_stats(2))
    assert len(engines) == 2

    MAX = 600
    bodies = [{"prompt": f"Stream {i}: tell me about topic {i * 13}.", "max_tokens": MAX, "temperature": 0,
               "ignore_eos": True} for i in range(8)]
    victim = reps[0]
    outage = []

    async def main():
        progress = [[] for _ in bodies]
        async with httpx.AsyncClient(timeout=httpx.Timeout(120, read=30)) as ac:
            tasks = [asyncio.create_task(stream(ac, farm.base, b, p)) for b, p in zip(bodies, progress)]
            plain = [asyncio.create_task(post(ac, farm.base, {**b, "prompt": "Not streamed " + b["prompt"]}))
                     for b in bodies[:2]]
            deadline = time.monotonic() + 60
            while min(map(len, progress)) < 3:  # every stream is under way
                assert time.monotonic() < deadline and not any(t.done() for t in tasks + plain)
                await asyncio.sleep(0.05)
            t_kill = time.monotonic()
            os.kill(victim.pid, signal.SIGKILL)
            # New requests during the outage go to the surviving replica.
            for i in range(4):
                outage.append(await ac.post(f"{farm.base}/v1/completions", json={
                    "prompt": f"During the outage {i}", "max_tokens": 4, "temperature": 0}))
            results = await asyncio.wait_for(asyncio.gather(*tasks), timeout=150)
            plain_results = await asyncio.wait_for(asyncio.gather(*plain), timeout=150)
            return t_kill, results, plain_results

    t_kill, results, plain_results = asyncio.run(main())
    ok = [r for r in results if complete_fully(r, MAX)]
    failed = [r for r in results if not complete_fully(r, MAX)]
    print(f"\nkill: {len(ok)} streams complete, {len(failed)} cut; "
          + "; ".join(f"{r['chunks']} chunks, done={r['done']}, {r['error']!r:.160}, ended {r['end'] - t_kill:.1f}s after"
                      for r in failed))
    assert failed, "the killed replica had streams in flight"
    assert ok, "the surviving replica's streams finish"
    for r in failed:
        assert r["error"] is not None, f"a cut stream must end with an error the client sees: {r}"
        assert not r["done"], r
        assert r["end"] - t_kill < 20, f"the stream hung {r['end'] - t_kill:.0f}s after the kill"
    for resp in outage:
        assert resp.status_code == 200, resp.text
    print("kill, not streamed: " + "; ".join(f"HTTP {r['status']} {str(r['body'])[:100]!r} {r['error']}, "
                                             f"ended {r['end'] - t_kill:.1f}s after" for r in plain_results))
    for r in plain_results:  # served in full (on the survivor), or a prompt 5xx
        if r["status"] == 200:
            assert r["body"]["usage"]["completion_tokens"] == MAX, r
        else:
            assert r["error"] is not None or r["status"] >= 500, r
            assert r["end"] - t_kill < 20, r

    # Serve replaces the replica (a new actor on the freed Mac).
    reps2 = farm.wait_replicas(2, 90, exclude={victim.actor_id})
    assert {a.node_id for a in reps2} == farm.mac_nodes()
    farm.wait_running(2, 90)
    # The router dropped the dead replica's state: everything still routes and succeeds,
    # the prefix once cached on the dead replica included.
    for _ in range(4):
        r = complete(farm.base, probe)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == probe_text, r.text
    after = set(farm.replica_stats(2))  # the new replica is in the router's rotation
    assert len(after) == 2 and len(after & engines) == 1, (engines, after)


# --- 3. bounded soak -------------------------------------------------------------------
SOAK_S = float(os.environ.get("MACFARM_SOAK_S", 12))  # bounded in make test; MACFARM_SOAK_S=600 for a real soak
SOAK_STREAMS = 64
SOAK_TOKENS = 24
SOAK_MAX_REQUESTS = SOAK_STREAMS * 60  # a bound besides the clock (about 470 fit in 20 s here)


def test_soak_64_streams(farm, model):
    farm.ensure_macs(2)
    farm.deploy(num_replicas=2)
    reps = farm.wait_replicas(2, 90)
    m, tok = model
    # Distinct prompts, a different one per stream at any time; later rounds repeat them
    # (prefix-cache hits). The references take ~7 s on 2 cores: 64 prompts, 24 tokens.
    prompts = [f"Soak prompt {i}: the {i % 7}th river flows past stone {i * 31}." for i in range(SOAK_STREAMS)]
    refs = {p: tok.decode(reference_greedy(m, tok.encode(p), SOAK_TOKENS), skip_special_tokens=True) for p in prompts}
    procs = [psutil.Process(a.pid) for a in reps]  # the replicas run on this machine

    async def main():
        stop_at = [None]
        counts, bad, rss0 = {"done": 0, "started": 0}, [], []

        async def worker(ac, w):
            k = w
            while (stop_at[0] is None or time.monotonic() < stop_at[0]) and counts["started"] < SOAK_MAX_REQUESTS:
                p = prompts[k % len(prompts)]
                k += 1
                counts["started"] += 1
                r = await stream(ac, farm.base, {"prompt": p, "max_tokens": SOAK_TOKENS, "temperature": 0, "ignore_eos": True})
                counts["done"] += 1
                if not complete_fully(r, SOAK_TOKENS) or r["text"] != visible(refs[p]):
                    bad.append((p, refs[p], r))
                if stop_at[0] is None and counts["done"] >= SOAK_STREAMS:  # warmed up: start the clock
                    rss0.extend(pr.memory_info().rss for pr in procs)
                    stop_at[0] = time.monotonic() + SOAK_S

        limits = httpx.Limits(max_connections=SOAK_STREAMS + 8, max_keepalive_connections=SOAK_STREAMS + 8)
        async with httpx.AsyncClient(timeout=120, limits=limits) as ac:
            await asyncio.wait_for(asyncio.gather(*[worker(ac, w) for w in range(SOAK_STREAMS)]), SOAK_S + 120)
        return counts, bad, rss0

    t0 = time.monotonic()
    counts, bad, rss0 = asyncio.run(main())
    rss1 = [pr.memory_info().rss for pr in procs]
    growth = [(b - a) / 2**20 for a, b in zip(rss0, rss1)]
    print(f"\nsoak: {counts['done']} streams in {time.monotonic() - t0:.0f}s, RSS MB "
          f"{[round(x / 2**20) for x in rss0]} -> {[round(x / 2**20) for x in rss1]}")
    assert counts["done"] == counts["started"]
    assert not bad, f"{len(bad)} wrong of {counts['done']}: {bad[:3]}"
    assert all(g < 200 for g in growth), growth
    assert farm.wait_replicas(2, 1) and {a.pid for a in farm.replicas()} == {p.pid for p in procs}  # no restarts


# --- 4. graceful drain -----------------------------------------------------------------
def test_delete_drains_streams_in_flight(farm):
    farm.ensure_macs(2)
    farm.deploy(num_replicas=2)
    MAX = 500  # 5-10 s: several of Serve's 2 s graceful-shutdown wait loops
    bodies = [{"prompt": f"Drain {i}: a long story about {i}.", "max_tokens": MAX, "temperature": 0,
               "ignore_eos": True} for i in range(4)]

    async def main():
        progress = [[] for _ in bodies]
        async with httpx.AsyncClient(timeout=httpx.Timeout(120, read=60)) as ac:
            tasks = [asyncio.create_task(stream(ac, farm.base, b, p)) for b, p in zip(bodies, progress)]
            deadline = time.monotonic() + 60
            while min(map(len, progress)) < 3:
                assert time.monotonic() < deadline and not any(t.done() for t in tasks)
                await asyncio.sleep(0.05)
            t_del = time.monotonic()
            delete = asyncio.create_task(asyncio.to_thread(farm.delete))
            results = await asyncio.wait_for(asyncio.gather(*tasks), timeout=90)
            await asyncio.wait_for(delete, timeout=90)
            return t_del, results, time.monotonic()

    t_del, results, t_gone = asyncio.run(main())
    print("\ndrain: " + "; ".join(f"{r['chunks']} chunks, done={r['done']}, {r['error']!r:.120}, "
                                  f"ended {r['end'] - t_del:.1f}s after delete" for r in results)
          + f"; app gone {t_gone - t_del:.1f}s after delete")
    for r in results:
        assert complete_fully(r, MAX), r


# --- 5. KV pool exhaustion -------------------------------------------------------------
def test_kv_pool_exhaustion_preempts_and_completes(farm, model):
    farm.ensure_macs(1)
    # 256 tokens = 16 pages; 16 requests of ~80 tokens each need ~80 pages together.
    farm.deploy(num_replicas=1, engine={"max_total_tokens": 256, "max_batched_tokens": 256})
    m, tok = model
    MAX = 64
    prompts = [f"Pool {i}: count the sheep in field {i * 17}." for i in range(16)]
    refs = [tok.decode(reference_greedy(m, tok.encode(p), MAX), skip_special_tokens=True) for p in prompts]

    async def main():
        async with httpx.AsyncClient(timeout=180) as ac:
            return await asyncio.gather(*[stream(ac, farm.base, {"prompt": p, "max_tokens": MAX, "temperature": 0,
                                                                 "ignore_eos": True}) for p in prompts])

    results = asyncio.run(main())
    for r, ref in zip(results, refs):
        assert complete_fully(r, MAX), r
        assert r["text"] == visible(ref)
    st = httpx.get(f"{farm.base}/v1/stats", timeout=30).json()["replica"]
    print(f"\nkv exhaustion: {st}")
    assert st["preemptions"] > 0, st
    assert st["kv_pages_total"] == 16 and st["running"] == 0 and st["waiting"] == 0
    assert farm.wait_replicas(1, 1)


def test_prompt_larger_than_the_pool_is_a_400_at_admission(farm):
    farm.ensure_macs(1)
    farm.deploy(num_replicas=1, engine={"max_total_tokens": 256, "max_batched_tokens": 256})
    prompt = " ".join(["sheep"] * 400)  # > 256 tokens, < the model's 1,024 context
    for stream in (False, True):
        r = httpx.post(f"{farm.base}/v1/completions", json={"prompt": prompt, "max_tokens": 4, "stream": stream},
                       timeout=60)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["code"] == "context_length_exceeded" and "KV pool" in err["message"], err
    ok = httpx.post(f"{farm.base}/v1/completions", json={"prompt": "Still serving?", "max_tokens": 4}, timeout=60)
    assert ok.status_code == 200, ok.text


def test_a_failing_step_is_a_500_or_an_sse_error_and_the_replica_serves_on(farm, tmp_path_factory):
    """A tiny gpt_bigcode raises inside its forward on a decode step of rows at different
    positions (it takes one integer offset for the batch; the load-time probe that gives it
    one forward per position is overridden): both requests of that step end with an error
    in OpenAI's shape, and the same replica answers the next request."""
    farm.ensure_macs(1)
    path = str(tiny_model_dir(tmp_path_factory, "gpt_bigcode"))
    farm.deploy(model=path, num_replicas=1, engine={**ENGINE, "batching": "ragged"})
    before = [a.actor_id for a in farm.replicas()]

    async def main():
        async with httpx.AsyncClient(timeout=120) as ac:
            streamed = stream(ac, farm.base, {"prompt": "a b c d e f g h i j k l m n o p q r s", "max_tokens": 400,
                                              "ignore_eos": True, "temperature": 0})
            plain = ac.post(f"{farm.base}/v1/completions", json={"prompt": "one two", "max_tokens": 400,
                                                                 "ignore_eos": True, "temperature": 0})
            return await asyncio.gather(streamed, plain)

    streamed, plain = asyncio.run(main())
    assert plain.status_code == 500 and plain.json()["error"]["code"] == "engine_error", plain.text
    assert plain.json()["error"]["type"] == "server_error"
    assert streamed["status"] == 200 and not streamed["done"] and "engine_error" in str(streamed["error"]), streamed
    ok = httpx.post(f"{farm.base}/v1/completions", json={"prompt": "still there", "max_tokens": 4}, timeout=60)
    assert ok.status_code == 200, ok.text
    assert [a.actor_id for a in farm.replicas()] == before  # not restarted
    st = httpx.get(f"{farm.base}/v1/stats", timeout=30).json()["replica"]
    assert st["failed_steps"] >= 1 and st["kv_pages_used"] == 0

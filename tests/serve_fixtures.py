"""A real local Ray cluster with the macfarm app on a tiny model: one shared by the modules
that need no cluster of their own (`serving`), or a module's own."""

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import ray
from ray import serve
from tiny_models import save_tiny_model

from mlx_worker.models.gguf import default_model_path
from serve_app.app import build_app

ENGINE = {"max_total_tokens": 4096, "max_batched_tokens": 256}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tiny_model_dir(tmp_path_factory, arch="llama", **overrides):
    return save_tiny_model(arch, tmp_path_factory.mktemp(arch), tokenizer_dir=default_model_path(), **overrides)


SHARED_CPUS = 8  # logical: how many replicas the modules sharing the cluster may run at once
_shared = {"base": None}  # the local cluster modules share, while it runs


def start_serve(num_cpus=4, **ray_kw):
    """A fresh local Ray cluster with Serve's proxy on a free port; returns the base URL."""
    ray_kw.setdefault("address", "local")  # never join a cluster already running here
    if ray.is_initialized():  # never reuse another module's cluster and its apps
        stop_serve()
    port = free_port()
    ray.init(num_cpus=num_cpus, include_dashboard=False, **ray_kw)
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    return f"http://127.0.0.1:{port}"


@contextlib.contextmanager
def serving(num_cpus=SHARED_CPUS, **ray_kw):
    """A local cluster with Serve for one module: the one modules share (started once,
    ~12 s saved a module), whose apps the module deployed are deleted when it ends; or,
    with Ray options of its own (`ray_kw`) or other CPUs, a cluster of its own."""
    if ray_kw or num_cpus != SHARED_CPUS:
        base = start_serve(num_cpus, **ray_kw)
        try:
            yield base
        finally:
            stop_serve()
        return
    if _shared["base"] is None or not ray.is_initialized():
        _shared["base"] = start_serve(SHARED_CPUS)
    before = set(serve.status().applications)
    try:
        yield _shared["base"]
    finally:
        delete_apps(set(serve.status().applications) - before)


def delete_apps(names, timeout: float = 60) -> None:
    """Delete Serve apps all at once (one by one, each waits for its replicas to drain)."""
    for name in names:
        serve.delete(name, _blocking=False)
    deadline = time.time() + timeout
    while set(names) & set(serve.status().applications) and time.time() < deadline:
        time.sleep(0.2)


def wait_healthy(base: str, timeout: float = 120) -> None:
    """Poll `base`/health until it answers 200."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            if httpx.get(f"{base}/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{base} did not come up")


@contextlib.contextmanager
def serve_run(config_path: Path, port: int, cwd: Path):
    """`serve run` on a config as a user starts it (its own local Ray cluster); yields the
    base URL once healthy. Torn down with everything it started: Ray's processes outlive
    `serve run` when it is interrupted, and would eat the next tests' CPU."""
    import psutil  # after ray (imported above): Ray ships psutil in ray/thirdparty_files

    stop_serve()  # a cluster this process shared with earlier modules: not beside a user's
    serve_bin = str(Path(sys.executable).with_name("serve"))
    proc = subprocess.Popen([serve_bin, "run", "--address", "local", str(config_path)], cwd=cwd,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    leader = psutil.Process(proc.pid)
    tree = {}
    try:
        base = f"http://127.0.0.1:{port}"
        wait_healthy(base, timeout=240)
        yield base
    finally:
        with contextlib.suppress(psutil.Error):
            tree = {p.pid: p for p in leader.children(recursive=True)}
        os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C: serve run tears the app and its cluster down
        try:
            proc.wait(timeout=10)  # past this it hangs on draining replicas: killed with its tree below
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        for p in tree.values():
            with contextlib.suppress(psutil.Error):
                p.kill()
        psutil.wait_procs(list(tree.values()), timeout=10)


def run_app(base: str, name: str, route: str, **args):
    run_apps(base, [(name, route, args)])


def run_apps(base: str, apps) -> None:
    """Deploy (name, route, args) apps, all before waiting for any: their replicas start
    side by side."""
    for name, route, args in apps:
        serve.run(build_app(args), name=name, route_prefix=route, blocking=False)
    for _, route, _ in apps:
        wait_healthy(f"{base}{route.rstrip('/')}")


def stop_serve():
    """Serve and the Ray cluster this process joined (the shared one too)."""
    _shared["base"] = None
    if not ray.is_initialized():
        return
    try:
        serve.shutdown()
    finally:
        ray.shutdown()


def stop_farm(cluster) -> None:
    """stop_serve, then the simulated farm (a ray.cluster_utils.Cluster) under it."""
    try:
        stop_serve()
    finally:
        cluster.shutdown()

"""A real local Ray cluster with the macfarm app on a tiny model, shared by a module."""

import contextlib
import socket
import time

import httpx
import ray
from ray import serve
from tiny_models import save_tiny_model

from mlx_worker.gguf import default_model_path
from serve_app.app import build_app

ENGINE = {"max_total_tokens": 4096, "max_batched_tokens": 256}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tiny_model_dir(tmp_path_factory, arch="llama"):
    return save_tiny_model(arch, tmp_path_factory.mktemp(arch), tokenizer_dir=default_model_path())


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
def serving(num_cpus=4, **ray_kw):
    """start_serve ... stop_serve, torn down even when the module's set-up fails."""
    base = start_serve(num_cpus, **ray_kw)
    try:
        yield base
    finally:
        stop_serve()


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


def run_app(base: str, name: str, route: str, **args):
    serve.run(build_app(args), name=name, route_prefix=route, blocking=False)
    wait_healthy(f"{base}{route.rstrip('/')}")


def stop_serve():
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

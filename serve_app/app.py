"""The application builder: `serve run serve_app.app:build_app` or deploy/app.yaml."""

import os
from typing import Any, Dict, List, Optional, Tuple, Union

import ray
from ray import serve

from mlx_worker.memory.paging import PAGE_SIZE

from .config import AppArgs
from .ingress import Ingress
from .replicas.rank_group import group_bundles
from .replicas.replica import MLXReplica


def _groups(args: AppArgs) -> List[Tuple[str, AppArgs, Optional[float]]]:
    """Each replica group: its deployment's name, the AppArgs of an app of that group
    alone, and its weight (None: its replica count)."""
    if not args.replica_groups:
        return [("MLXReplica", args, None)]
    names = [g.name for g in args.replica_groups]
    if len(set(names)) != len(names):
        raise ValueError(f"replica group names must differ: {names}")
    for g in args.replica_groups:
        if g.engine.get("page_size", args.engine.get("page_size", PAGE_SIZE)) != args.engine.get("page_size", PAGE_SIZE):
            raise ValueError(f"replica group {g.name!r}: every group needs the app's page_size (the ingress hashes pages)")
    return [(f"MLXReplica_{g.name}", args.model_copy(update={
        "engine": {**args.engine, **g.engine},
        "num_replicas": args.num_replicas if g.num_replicas is None else g.num_replicas,
        "replica_resource": g.replica_resource if "replica_resource" in g.model_fields_set else args.replica_resource,
    }), g.weight) for g in args.replica_groups]


DRAIN_S = 30  # a stopping deployment finishes its requests in flight for this long


def _replica_options(args: AppArgs) -> Dict[str, Any]:
    resources = ray.cluster_resources() if ray.is_initialized() else {}
    resource = args.replica_resource
    if resource == "auto":
        resource = "mac" if resources.get("mac") else None
    ranks = int(args.engine.get("tensor_parallel_size", 1)) * int(args.engine.get("pipeline_parallel_size", 1))
    n = args.num_replicas
    if n == "auto":  # one replica per group of `ranks` Macs
        n = max(1, int(resources.get(resource, 1)) // ranks) if resource else 1
    actor = {"num_cpus": 1}
    if resource:
        actor["resources"] = {resource: 1}
    opts: Dict[str, Any] = dict(
        num_replicas=n,
        ray_actor_options=actor,
        max_ongoing_requests=args.max_ongoing_requests,
        max_queued_requests=args.max_queued_requests,
        health_check_period_s=2,  # a dead replica (or a rank of its group) is restarted within ~6 s
        graceful_shutdown_timeout_s=DRAIN_S,
    )
    if ranks > 1:  # rank 0 (the replica) in bundle 0, each other rank on a Mac of its own
        opts["placement_group_bundles"] = group_bundles(ranks, resource)
        opts["placement_group_strategy"] = "STRICT_SPREAD" if resource else "PACK"
    if args.router == "prefix":
        opts["request_router_config"] = {
            "request_router_class": "serve_app.routing.router:PrefixAffinityRouter",
            "request_router_kwargs": {"page_size": args.engine.get("page_size", PAGE_SIZE), **args.router_kwargs},
            "request_routing_stats_period_s": 1,
        }
    return opts


def build_app(args: AppArgs) -> serve.Application:
    """Serve's application builder (`import_path: serve_app.app:build_app`). Serve
    requires exactly one parameter and validates the config's `args:` into AppArgs."""
    return compose_app(args)


def compose_app(
    args: Union[AppArgs, Dict[str, Any], None] = None, request_router_config: Optional[Dict[str, Any]] = None
) -> serve.Application:
    """The app; `request_router_config` replaces the one `args.router` selects (e.g. a
    router class object, as the routing benchmark's baselines are)."""
    args = AppArgs.model_validate(args or {})
    args.api_key = args.api_key or os.environ.get("MACFARM_API_KEY") or None
    replicas, weights = {}, {}
    for name, group, weight in _groups(args):
        opts = _replica_options(group)
        if request_router_config is not None:
            opts["request_router_config"] = request_router_config
        replicas[name] = MLXReplica.options(name=name, **opts).bind({**group.engine, "model": args.model})
        weights[name] = weight or opts["num_replicas"]
    ingress = Ingress.options(max_ongoing_requests=1000, ray_actor_options={"num_cpus": 0},
                              graceful_shutdown_timeout_s=DRAIN_S)  # its streams drain as long as the replicas'
    return ingress.bind(replicas, args.model_dump(), weights)

"""The application builder: `serve run serve_app.app:build_app` or deploy/app.yaml."""

import os
import re
from typing import Any, Dict, List, Optional, Tuple, Union

import ray
from ray import serve

from mlx_worker.memory.paging import PAGE_SIZE

from mlx_worker.config import EngineConfig

from .config import AppArgs, ModelArgs
from .ingress import Ingress
from .models.placement import MEMORY_RESOURCE, replica_memory
from .models.residency import autoscaling_config
from .replicas.rank_group import group_bundles
from .replicas.replica import MLXReplica


def _groups(args: AppArgs, prefix: str = "MLXReplica") -> List[Tuple[str, AppArgs, Optional[float]]]:
    """Each replica group: its deployment's name, the AppArgs of an app of that group
    alone, and its weight (None: its replica count)."""
    if not args.replica_groups:
        return [(prefix, args, None)]
    names = [g.name for g in args.replica_groups]
    if len(set(names)) != len(names):
        raise ValueError(f"replica group names must differ: {names}")
    for g in args.replica_groups:
        if g.engine.get("page_size", args.engine.get("page_size", PAGE_SIZE)) != args.engine.get("page_size", PAGE_SIZE):
            raise ValueError(f"replica group {g.name!r}: every group needs the app's page_size (the ingress hashes pages)")
    return [(f"{prefix}_{g.name}", args.model_copy(update={
        "engine": {**args.engine, **g.engine},
        "num_replicas": args.num_replicas if g.num_replicas is None else g.num_replicas,
        "replica_resource": g.replica_resource if "replica_resource" in g.model_fields_set else args.replica_resource,
    }), g.weight) for g in args.replica_groups]


DRAIN_S = 30  # a stopping deployment finishes its requests in flight for this long


SHARED_MAC = 0.01  # of the `mac` resource, a replica's when several models share the Macs


def _replica_options(args: AppArgs, entry: Optional[ModelArgs] = None, shared: bool = False) -> Dict[str, Any]:
    """A replica deployment's Serve options. `shared`: several models share the Macs (each
    replica takes a sliver of `mac`, one replica of a deployment per Mac, and Macs are
    packed by the memory each replica declares)."""
    resources = ray.cluster_resources() if ray.is_initialized() else {}
    resource = args.replica_resource
    if resource == "auto":
        resource = "mac" if resources.get("mac") else None
    ranks = int(args.engine.get("tensor_parallel_size", 1)) * int(args.engine.get("pipeline_parallel_size", 1))
    n = args.num_replicas
    if n == "auto":  # one replica per group of `ranks` Macs
        n = max(1, int(resources.get(resource, 1)) // ranks) if resource else 1
    actor: Dict[str, Any] = {"num_cpus": 1}
    if resource:
        actor["resources"] = {resource: SHARED_MAC if shared and ranks == 1 else 1}
    memory = _replica_memory(args, entry, resource) if ranks == 1 else None
    if memory:
        actor.setdefault("resources", {})[MEMORY_RESOURCE] = memory
    opts: Dict[str, Any] = dict(
        num_replicas=n,
        ray_actor_options=actor,
        max_ongoing_requests=args.max_ongoing_requests,
        max_queued_requests=args.max_queued_requests,
        health_check_period_s=2,  # a dead replica (or a rank of its group) is restarted within ~6 s
        graceful_shutdown_timeout_s=DRAIN_S,
    )
    if shared and ranks == 1 and resource:
        opts["max_replicas_per_node"] = 1
    if entry is not None and entry.min_replicas is not None and (entry.min_replicas < n or entry.pin):
        per_replica = EngineConfig.model_validate(args.engine).max_running_requests
        opts["autoscaling_config"] = autoscaling_config(entry.min_replicas, n, entry.idle_unload_s, entry.pin,
                                                        per_replica)
        del opts["num_replicas"]
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


def _replica_memory(args: AppArgs, entry: Optional[ModelArgs], resource: Optional[str]) -> Optional[float]:
    """The `mac_memory_gb` one replica declares (placement.py); None: none."""
    macs = [n["Resources"] for n in ray.nodes() if n.get("Alive") and (not resource or n["Resources"].get(resource))] \
        if ray.is_initialized() else []
    name = entry.name if entry else (args.model_name or args.model or "default")
    return replica_memory(name, args.model, args.engine, macs)


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
    replicas, weights, memory, taken = {}, {}, {}, set()
    for entry in args.served_models():
        model_args = args.for_model(entry)
        prefix = deployment_prefix(entry.name, taken) if args.models else "MLXReplica"
        replicas[entry.name], weights[entry.name] = {}, {}
        for name, group, weight in _groups(model_args, prefix):
            opts = _replica_options(group, entry, shared=len(args.served_models()) > 1)
            if request_router_config is not None:
                opts["request_router_config"] = request_router_config
            replicas[entry.name][name] = MLXReplica.options(name=name, **opts).bind(
                {**group.engine, "model": entry.model})
            weights[entry.name][name] = weight or opts.get("num_replicas") or opts["autoscaling_config"]["max_replicas"]
            memory[entry.name] = opts["ray_actor_options"].get("resources", {}).get(MEMORY_RESOURCE)
    ingress = Ingress.options(max_ongoing_requests=1000, ray_actor_options={"num_cpus": 0},
                              graceful_shutdown_timeout_s=DRAIN_S)  # its streams drain as long as the replicas'
    return ingress.bind(replicas, args.model_dump(exclude_unset=True), weights, memory)


def deployment_prefix(model_name: str, taken: set) -> str:
    """The replica deployments' name of a model of `models:` (MLXReplica_<name>, made safe)."""
    base = "MLXReplica_" + re.sub(r"[^A-Za-z0-9_]", "_", model_name)
    name, i = base, 2
    while name in taken:
        name, i = f"{base}_{i}", i + 1
    taken.add(name)
    return name

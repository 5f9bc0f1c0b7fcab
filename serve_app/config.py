"""The app's configuration: the `args:` of `serve_app.app:build_app` in deploy/app.yaml."""

from typing import Any, Dict, List, Literal, Optional, Union

from pydantic import Field, model_validator

from mlx_worker.config import EngineConfig
from mlx_worker.strict_model import StrictModel, check_keys

from .routing.prefix_policy import PrefixAffinityConfig


class ReplicaGroupArgs(StrictModel):
    """One kind of replica in an app whose replicas differ: e.g. ordinary Macs one each,
    and a pair of other Macs that serve the same model tensor parallel. Unset fields
    take the app's."""

    name: str = Field(pattern=r"^[A-Za-z0-9_]+$")
    """The group's name; its deployment is MLXReplica_<name>."""
    num_replicas: Union[int, Literal["auto"], None] = None
    """Replicas of this group; null: the app's num_replicas."""
    replica_resource: Optional[str] = "auto"
    """The custom resource each of its replicas (each of their Macs) takes."""
    engine: Dict[str, Any] = Field(default_factory=dict)
    """Engine keys over the app's `engine:` (e.g. tensor_parallel_size: 2)."""
    weight: Optional[float] = Field(None, gt=0)
    """Its share of new prompts; null: its replica count."""


class AppArgs(StrictModel):
    """Typed arguments of the macfarm app (the `args:` of a Serve config)."""

    model: Optional[str] = None
    """HF id, mlx-lm directory or .gguf file; null: the embedded SmolLM2-135M-Instruct."""
    model_name: Optional[str] = None
    """The name clients use in `model`; null: derived from `model`."""
    num_replicas: Union[int, Literal["auto"]] = "auto"
    """auto: one replica per Mac (per `replica_resource`), else 1."""
    replica_resource: Optional[str] = "auto"
    """Custom resource one per Mac; auto: "mac" when the cluster has it, else none."""
    engine: Dict[str, Any] = Field(default_factory=dict)
    """The engine's keys (EngineConfig, below)."""
    router: Literal["prefix", "pow2"] = "prefix"
    """prefix: the prefix-affinity router; pow2: Ray Serve's default power-of-two choices."""
    router_kwargs: Dict[str, Any] = Field(default_factory=dict)
    """The prefix router's knobs (PrefixAffinityConfig in serve_app/routing/prefix_policy.py)."""
    max_ongoing_requests: int = Field(128, ge=1)
    """Requests one replica holds at once; its engine queues beyond its batch."""
    max_queued_requests: int = Field(512, ge=-1)
    """Requests waiting at the ingress for a replica; beyond it the ingress answers 429 (-1: no bound)."""
    default_max_tokens: int = Field(512, ge=1)
    """Output tokens of a request that names no max_tokens."""
    api_key: Optional[str] = None
    """Bearer token clients must send; also $MACFARM_API_KEY; null: open."""
    retry_after_s: int = 1
    """Retry-After of the ingress's own 429 (its queue full)."""
    replica_groups: List[ReplicaGroupArgs] = Field(default_factory=list)
    """Replicas of different sizes in one app (docs/cluster.md section 8)."""

    @model_validator(mode="after")
    def _engine_keys(self):
        """The engine keys, the app's and each group's, checked now: a typo fails the
        deploy with its name instead of running the defaults (the router's keys too)."""
        EngineConfig.model_validate({**self.engine, "model": self.model})
        check_keys(PrefixAffinityConfig, self.router_kwargs)
        PrefixAffinityConfig.model_validate(self.router_kwargs)
        for group in self.replica_groups:
            EngineConfig.model_validate({**self.engine, **group.engine, "model": self.model})
        return self

"""The app's configuration: the `args:` of `serve_app.app:build_app` in deploy/app.yaml."""

from typing import Any, Dict, List, Literal, Optional, Union

from pydantic import Field, model_validator

from mlx_worker.config import EngineConfig
from mlx_worker.strict_model import StrictModel, check_keys

from .model_files import served_name
from .routing.prefix_policy import PrefixAffinityConfig
from .vision.image_args import ImageArgs


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


class ModelArgs(StrictModel):
    """One model of an app that serves several (`models:`). Unset fields take the app's."""

    name: str = Field(pattern=r"^[^\s:]+$")
    """The id clients send as `model` (no spaces, no colon: `base:adapter` picks an adapter)."""
    model: Optional[str] = None
    """HF id, mlx-lm directory or .gguf file; null: the embedded SmolLM2-135M-Instruct."""
    adapters: Dict[str, str] = Field(default_factory=dict)
    """LoRA adapters on this model: name -> directory (mlx-lm's format or PEFT's); clients send the name, or `model:name`."""
    engine: Dict[str, Any] = Field(default_factory=dict)
    """Engine keys merged over the app's `engine:`, key by key."""
    num_replicas: Union[int, Literal["auto"], None] = None
    """Its replicas at most; null: the app's num_replicas."""
    min_replicas: Optional[int] = Field(None, ge=0)
    """Replicas kept loaded; 0: loaded on its first request, unloaded after idle_unload_s; null: num_replicas (always loaded)."""
    idle_unload_s: float = Field(600, gt=0)
    """A model with min_replicas below its replicas gives back the ones idle this long."""
    pin: bool = False
    """Never unloaded to make room for another model (idle unloading still follows min_replicas)."""
    replica_resource: Optional[str] = "auto"
    """The custom resource each of its replicas takes; unset: the app's."""
    replica_groups: Optional[List[ReplicaGroupArgs]] = None
    """Its replicas of different sizes; null: the app's replica_groups."""


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
    adapters: Dict[str, str] = Field(default_factory=dict)
    """LoRA adapters on the app's one model: name -> directory (with `models:`, each model's own)."""
    images: ImageArgs = Field(default_factory=ImageArgs)
    """Images in requests to vision models: how many, how large, whether URLs are fetched (docs/vision.md)."""
    models: List[ModelArgs] = Field(default_factory=list)
    """Several models in one app (docs/models.md); absent: the one model of `model:`. A request without `model` goes to the first."""

    @model_validator(mode="after")
    def _engine_keys(self):
        """The engine keys, the app's, each model's and each group's, checked now: a typo
        fails the deploy with its name instead of running the defaults (the router's keys
        too); and the names clients use, each naming one model or adapter."""
        if self.models:
            beside = sorted(k for k in ("model", "model_name", "adapters") if k in self.model_fields_set)
            if beside:
                raise ValueError(f"{', '.join(beside)} beside models: give each model its own in its entry")
        names = [n for m in self.served_models() for n in (m.name, *m.adapters)]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ValueError(f"two models or adapters have the name {twice[0]!r}; each name must be unique")
        if any(":" in n for n in names):
            raise ValueError(f"a name cannot contain ':' (base:adapter picks an adapter): {names}")
        check_keys(PrefixAffinityConfig, self.router_kwargs)
        PrefixAffinityConfig.model_validate(self.router_kwargs)
        for m in self.served_models():
            args = self.for_model(m)
            EngineConfig.model_validate({**args.engine, "model": m.model})
            for group in args.replica_groups:
                EngineConfig.model_validate({**args.engine, **group.engine, "model": m.model})
            if m.min_replicas is not None and isinstance(args.num_replicas, int) and m.min_replicas > args.num_replicas:
                raise ValueError(f"model {m.name!r}: min_replicas {m.min_replicas} is above its num_replicas "
                                 f"{args.num_replicas}")
            if m.min_replicas is not None and args.replica_groups:
                raise ValueError(f"model {m.name!r}: min_replicas needs a model without replica_groups")
        return self

    def served_models(self) -> List[ModelArgs]:
        """The models this app serves: `models:`, or the one of `model:`."""
        if self.models:
            return list(self.models)
        return [ModelArgs(name=self.model_name or served_name(self.model), model=self.model, adapters=self.adapters)]

    def for_model(self, m: ModelArgs) -> "AppArgs":
        """The args of an app of model `m` alone: the app's, with the model's own over them."""
        engine = {**self.engine, **m.engine}
        if m.adapters:
            engine["adapters"] = {**engine.get("adapters", {}), **m.adapters}
        update = {"model": m.model, "model_name": m.name, "engine": engine, "models": [], "adapters": m.adapters}
        if m.num_replicas is not None:
            update["num_replicas"] = m.num_replicas
        if "replica_resource" in m.model_fields_set:
            update["replica_resource"] = m.replica_resource
        if m.replica_groups is not None:
            update["replica_groups"] = m.replica_groups
        return self.model_copy(update=update)

"""A replica that spans several Macs (tensor or pipeline parallel): rank 0 is the Serve
replica, the other ranks are Ray actors in the replica's placement group, one bundle (one
Mac) each.

The group starts in two phases so that a rank that cannot load its shard fails the
replica instead of leaving the others waiting in a collective: every rank joins the
mx.distributed group and loads its shard; then every rank builds its engine (whose
load-time probes already run the sharded model's all-reduces).
"""

import asyncio
from typing import List, Optional

import ray
from ray.util.placement_group import get_current_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from mlx_worker import Engine, EngineConfig
from mlx_worker.distributed.ranks import Ranks, free_port, start_ranks
from mlx_worker.models.loader import load_sharded

FOLLOWER_CHECK_S = 10.0


def group_bundles(size: int, resource: Optional[str]) -> List[dict]:
    """One bundle per rank; bundle 0 holds the replica actor itself."""
    return [{"CPU": 1, **({resource: 1} if resource else {})} for _ in range(size)]


class _Rank:
    """Rank k > 0 of a replica's group: loads its shard and replays the leader's steps."""

    def __init__(self):
        self.engine: Optional[Engine] = None

    def address(self) -> str:
        return f"{ray.util.get_node_ip_address()}:{free_port()}"

    def load(self, rank: int, hosts: List[str], leader: str, config: dict) -> None:
        self.config = EngineConfig(**config)
        self.ranks = start_ranks(rank, hosts, leader, self.config.distributed_backend, self.config.rdma_devices)
        self.model, self.tokenizer = load_sharded(self.config.model, self.config.dtype, self.ranks.group,
                                                  self.config.pipeline_parallel_size > 1)

    def build(self) -> None:
        self.engine = Engine(self.config, self.model, self.tokenizer, ranks=self.ranks)

    def check(self) -> None:
        if self.engine is not None and self.engine.error is not None:
            raise RuntimeError(f"rank {self.ranks.rank}: {self.engine.error!r}")


FollowerRank = ray.remote(_Rank)


class RankGroup:
    """The leader's side of a group: starts the followers, then owns their handles."""

    def __init__(self, config: EngineConfig):
        pg = get_current_placement_group()
        if pg is None:
            raise RuntimeError("a replica of several ranks needs its placement group (see serve_app/app.py)")
        size, group_id = config.tensor_parallel_size * config.pipeline_parallel_size, pg.id.hex()[:12]
        self.followers = [
            FollowerRank.options(name=f"macfarm-rank{i}-{group_id}", num_cpus=1,
                                 scheduling_strategy=PlacementGroupSchedulingStrategy(
                                     pg, placement_group_bundle_index=i)).remote() for i in range(1, size)
        ]
        ip = ray.util.get_node_ip_address()
        hosts = [f"{ip}:{free_port()}"] + ray.get([f.address.remote() for f in self.followers])
        leader = f"{ip}:{free_port()}"
        cfg = config.model_dump()
        loads = [f.load.remote(i, hosts, leader, cfg) for i, f in enumerate(self.followers, 1)]
        self.ranks: Ranks = start_ranks(0, hosts, leader, config.distributed_backend, config.rdma_devices)
        self.model, self.tokenizer = load_sharded(config.model, config.dtype, self.ranks.group,
                                                  config.pipeline_parallel_size > 1)
        ray.get(loads)  # a rank that could not load fails the replica here, before any collective
        self._builds = [f.build.remote() for f in self.followers]

    def engine(self, config: EngineConfig) -> Engine:
        engine = Engine(config, self.model, self.tokenizer, ranks=self.ranks)
        ray.get(self._builds)
        return engine

    async def check(self) -> None:
        """Raises when a follower is gone or its engine died."""
        await asyncio.wait_for(asyncio.gather(*[f.check.remote() for f in self.followers]), FOLLOWER_CHECK_S)

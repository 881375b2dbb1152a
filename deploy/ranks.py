"""Tensor-parallel follower ranks under Ray: each a task in its own bundle of the worker's placement group.

A worker with `tensor_parallel_size` N gets one placement group of N identical bundles, STRICT_PACK
(one node: the ranks' collectives and their step channel stay on the node). Its actor (rank 0)
holds bundle 0; `RayRanks.launch` starts rank r as a long-running Ray task in bundle r, with that
bundle's CPUs and GPU (Ray gives the task its own GPU, seen as cuda:0). The task ends when rank 0
stops the group or is gone; killing the worker's placement group removes every rank at once.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import ray
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from common.engine_config import EngineConfig

if TYPE_CHECKING:  # engine.parallel loads torch; the router and controller actors (deploy.actors) must not
    from engine.parallel import RankInfo


@ray.remote(max_retries=0)
def run_rank(config: EngineConfig, info: RankInfo) -> None:
    from engine.parallel.follower import serve_rank

    serve_rank(config, info)


class RayRank:
    def __init__(self, ref: ray.ObjectRef):
        self.ref = ref

    def is_alive(self) -> bool:
        done, _ = ray.wait([self.ref], timeout=0)
        return not done

    def kill(self) -> None:
        ray.cancel(self.ref, force=True)

    def join(self, timeout: float | None = None) -> None:
        ray.wait([self.ref], timeout=timeout)


class RayRanks:
    def __init__(self, pg: Any):
        self.pg = pg

    @classmethod
    def current(cls) -> RayRanks | None:
        """For the calling actor's placement group (None outside one)."""
        pg = ray.util.get_current_placement_group()
        return cls(pg) if pg is not None else None

    def launch(self, config: EngineConfig, info: RankInfo) -> RayRank:
        bundle = self.pg.bundle_specs[info.rank]
        custom = {k: v for k, v in bundle.items() if k not in ("CPU", "GPU")}
        options = {
            "num_cpus": bundle.get("CPU", 0),
            "num_gpus": bundle.get("GPU", 0),
            "scheduling_strategy": PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=info.rank),
            "name": f"pdserve:tp-rank{info.rank}",
            **({"resources": custom} if custom else {}),
        }
        return RayRank(run_rank.options(**options).remote(config, info))

"""Where the controller's actors run: one placement group per actor (per worker: one bundle per
tensor-parallel rank, STRICT_PACK; the actor is rank 0 in bundle 0, deploy/ranks.py places the rest).

Lifecycle of a placement: `Placement.bundle` turns a pool's (or the router's) resources into a
bundle (GPUs only when the cluster has some), `group` creates the placement group and waits until
it is ready (removing it again on timeout or failure), `actor_options` places an actor in that
group's bundle, using all of it; `dispose` kills the actor and removes its group (idempotent).
`wait_ref` awaits a Ray ObjectRef with a timeout from the controller's event loop.
"""

from __future__ import annotations

import asyncio
import logging

import ray
from ray.exceptions import GetTimeoutError
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

log = logging.getLogger(__name__)

NAMESPACE = "pdserve"
PLACEMENT_TIMEOUT_S = 300.0


class Placement:
    def __init__(self, detached: bool):
        self.detached = detached
        """Actors and placement groups outlive the driver that created them (`pdserve up`)."""
        self.has_gpus = ray.cluster_resources().get("GPU", 0) > 0

    def bundle(self, num_cpus: float, num_gpus: float, resources: dict[str, float]) -> dict[str, float]:
        bundle = {"CPU": float(num_cpus)} if num_cpus else {}
        bundle.update({k: float(v) for k, v in resources.items()})
        if num_gpus and self.has_gpus:
            bundle["GPU"] = float(num_gpus)
        elif num_gpus:
            log.warning("num_gpus=%s requested but the cluster has no GPU: placing on CPU only", num_gpus)
            bundle.setdefault("CPU", 1.0)
        return bundle

    def actor_options(self, name: str, pg) -> dict:
        """Options that place an actor in its placement group's only bundle, using all of it."""
        bundle = pg.bundle_specs[0]
        custom = {k: v for k, v in bundle.items() if k not in ("CPU", "GPU")}
        return {
            "num_cpus": bundle.get("CPU", 0),
            "num_gpus": bundle.get("GPU", 0),
            **({"resources": custom} if custom else {}),
            "scheduling_strategy": PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=0),
            "name": f"pdserve:{name}",
            "namespace": NAMESPACE,
            "lifetime": "detached" if self.detached else None,
            "max_restarts": 0,
        }

    async def group(self, name: str, bundle: dict, strategy: str, count: int = 1):
        """`count` bundles like `bundle` (a tensor-parallel worker: one per rank, on one node)."""
        pg = placement_group([bundle] * count, strategy="STRICT_PACK" if count > 1 else strategy, name=f"pdserve:{name}",
                             lifetime="detached" if self.detached else None)
        try:
            await wait_ref(pg.ready(), PLACEMENT_TIMEOUT_S)
        except GetTimeoutError:
            remove_placement_group(pg)
            raise RuntimeError(f"no room for {name}: it needs {bundle}, the cluster has {ray.available_resources()} free") from None
        except BaseException:
            remove_placement_group(pg)
            raise
        return pg


async def wait_ref(ref, timeout_s: float):
    """Await a Ray ObjectRef with a timeout."""
    try:
        return await asyncio.wait_for(asyncio.wrap_future(ref.future()), timeout_s)
    except TimeoutError:
        raise GetTimeoutError(f"no answer within {timeout_s:.0f} s") from None


def dispose(actor, pg) -> None:
    """Kill an actor and remove its placement group; either may be gone already (idempotent)."""
    if actor is not None:
        try:
            ray.kill(actor, no_restart=True)
        except Exception as exc:  # noqa: BLE001
            log.debug("kill: %r", exc)
    if pg is not None:
        try:
            remove_placement_group(pg)
        except Exception as exc:  # noqa: BLE001
            log.debug("remove placement group: %r", exc)

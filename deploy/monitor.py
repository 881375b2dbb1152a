"""The controller's eyes: one tick every interval reads the deployment, and `status()` reports it.

Lifecycle: the controller creates one `Monitor` and, once its pools started, runs `run()` as a task until
shutdown. Each `tick()`: read every ready worker's Stats (`refresh_stats`: an actor that died is removed from
its pool, an event says so), read the router's latency histograms into windowed TTFT/ITL quantiles, then ask
the controller to act: back to a pool's target after a loss, and, with `autoscaler.enabled`, each pool's
`PoolAutoscaler` (`pools` mode) or the one `AdaptivePolicy` (`adaptive` mode: local-prefill threshold to the
router, a role switch or a resize, each plan an event with its inputs). The controller owns the pools and
every change to them (deploy/controller.py); the monitor only reads and asks.
`status()` is the `pdserve status` report: router, pools and workers with health and load, the autoscaler's view.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from typing import TYPE_CHECKING, Any

import ray
from ray.exceptions import RayActorError

from deploy.adaptive import Snapshot
from deploy.autoscaler import PoolSignals, histogram_quantile, histogram_window
from deploy.placement import dispose, wait_ref
from deploy.slots import ROLES, Pool, WorkerSlot, worker_status

if TYPE_CHECKING:
    from deploy.controller import Controller

log = logging.getLogger(__name__)

HEALTH_INTERVAL_S = 2.0


async def refresh_stats(slots: list[WorkerSlot]) -> list[WorkerSlot]:
    """Fetch Stats of `slots` concurrently; returns those whose actor is dead."""
    async def fetch(slot: WorkerSlot) -> bool:
        try:
            slot.stats = await wait_ref(slot.actor.stats.remote(), 5.0)
            slot.stats_at = time.monotonic()
        except RayActorError:
            return slot.state == "ready"
        except Exception:  # noqa: BLE001 - slow or failing: keep the last stats, mark unknown
            slot.stats = None
        return False

    live = [s for s in slots if s.actor is not None]
    dead = await asyncio.gather(*(fetch(s) for s in live))
    return [s for s, d in zip(live, dead) if d]


class Monitor:
    def __init__(self, controller: Controller):
        self.controller = controller
        self.latency: dict[str, float | None] = {"ttft": None, "itl": None}
        self._latency_prev: dict[str, list] = {}
        self._cores: float | None = None

    async def run(self) -> None:
        scaler = self.controller.config.autoscaler
        interval = scaler.interval_s if scaler.enabled else min(HEALTH_INTERVAL_S, scaler.interval_s)
        while not self.controller.stopping:
            await asyncio.sleep(interval)
            try:
                await self.tick()
            except Exception:  # the monitor must survive a bad sample
                log.exception("controller tick failed")

    async def tick(self) -> None:
        ctrl = self.controller
        for pool in ctrl.pools.values():
            for slot in await refresh_stats(pool.ready()):
                log.warning("worker %s died; removing it", slot.worker_id)
                pool.workers.pop(slot.worker_id, None)
                dispose(slot.actor, slot.pg)
                ctrl.events.append({"time": time.time(), "pool": pool.role, "reason": f"{slot.worker_id} died"})
        await self.sample_latency()
        busy = any(pool.lock.locked() or len(pool.active()) < pool.target for pool in ctrl.pools.values())
        for pool in ctrl.pools.values():
            if pool.lock.locked() or ctrl.stopping:
                continue
            if len(pool.active()) < pool.target:
                asyncio.create_task(ctrl._scale_to(pool, pool.target, "replace lost workers"))
                continue
            if ctrl.config.autoscaler.enabled and ctrl.policy is None:
                decision = pool.autoscaler.decide(self.signals(pool))
                if decision is not None and decision.replicas != len(pool.active()):
                    asyncio.create_task(ctrl._scale_to(pool, decision.replicas, f"autoscaler: {decision.reason}"))
        if ctrl.config.autoscaler.enabled and ctrl.policy is not None and not ctrl.stopping:
            await self.adapt(busy)

    async def adapt(self, pool_busy: bool) -> None:
        """One adaptive plan: threshold to the router now; a role switch or resize as a task (they take seconds)."""
        ctrl = self.controller
        summary = await wait_ref(ctrl.router.summary.remote(ctrl.config.autoscaler.adaptive.window_s), 5.0)
        snapshot = Snapshot.from_router(time.monotonic(), self.signals(ctrl.pools["prefill"]), self.signals(ctrl.pools["decode"]),
                                        summary, pool_busy, free_cpus=self.free_cpus())
        plan = ctrl.policy.decide(snapshot)
        if not plan.acts:
            return
        reason = "; ".join(plan.reasons)
        ctrl.events.append({"time": time.time(), "pool": "controller", "from": snapshot.shape(), "to": plan.shape(snapshot),
                            "reason": reason, "inputs": snapshot.inputs()})
        log.warning("controller: %s -> %s (%s)", snapshot.shape(), plan.shape(snapshot), reason)
        if plan.local_prefill_threshold is not None:
            await wait_ref(ctrl.router.set_local_prefill_threshold.remote(plan.local_prefill_threshold), 5.0)
        if plan.switch_to is not None:
            source = ctrl.pools[ROLES[1 - ROLES.index(plan.switch_to)]]
            victim = (await ctrl._pick_victims(source, 1))[0]
            _spawn(ctrl.switch_role(victim.worker_id, plan.switch_to))
        if plan.resize is not None:
            role, n = plan.resize
            _spawn(ctrl._scale_to(ctrl.pools[role], n, f"controller: {reason}"))

    def free_cpus(self) -> float | None:
        """Cores that the router and the workers do not hold: on one node its cores (the launcher sizes Ray's logical
        CPUs for every pool's max_replicas, so Ray's free CPUs would not tell an oversubscribed machine), on several
        the cluster's CPUs. None: unknown (no Ray cluster)."""
        ctrl = self.controller
        if self._cores is None:
            try:
                nodes = [n for n in ray.nodes() if n.get("Alive")]
            except Exception:  # noqa: BLE001 -- no cluster (unit tests): unknown, the policy does not limit on it
                return None
            self._cores = len(os.sched_getaffinity(0)) if len(nodes) == 1 else sum(n["Resources"].get("CPU", 0.0) for n in nodes)
        held = ctrl.config.router.num_cpus + sum(len(pool.active()) * cfg.num_cpus * cfg.tensor_parallel_size
                                                 for pool, cfg in ((ctrl.pools[r], getattr(ctrl.config.pools, r)) for r in ROLES))
        return self._cores - held

    def signals(self, pool: Pool) -> PoolSignals:
        ready = pool.ready()
        return PoolSignals.from_stats(len(pool.active()), [w.stats for w in ready if w.stats],
                                      ttft_s=self.latency["ttft"], itl_s=self.latency["itl"])

    async def sample_latency(self) -> None:
        try:
            current = await wait_ref(self.controller.router.latency_buckets.remote(), 5.0)
        except Exception:  # noqa: BLE001
            return
        q = self.controller.config.autoscaler.latency_quantile
        for name, buckets in current.items():
            window = histogram_window(self._latency_prev.get(name), buckets)
            self.latency[name] = histogram_quantile(q, window)
        self._latency_prev = current

    async def status(self) -> dict:
        """The router's view, with the workers' Stats as the last tick read them (at most HEALTH_INTERVAL_S old; those
        older or never read are asked now, all at once): an operator polling status adds no load on the workers."""
        ctrl = self.controller
        slots = {role: list(pool.workers.values()) for role, pool in ctrl.pools.items()}
        stale = time.monotonic() - HEALTH_INTERVAL_S
        (router, registered), _ = await asyncio.gather(self._router_status(), refresh_stats(
            [s for ss in slots.values() for s in ss if s.state == "ready" and (s.stats is None or s.stats_at < stale)]))
        pools = {role: {
            "replicas": len(pool.active()),
            "target": pool.target,
            "min_replicas": pool.config.min_replicas,
            "max_replicas": pool.config.max_replicas,
            "workers": [worker_status(s, registered.get(s.worker_id)) for s in slots[role]],
        } for role, pool in ctrl.pools.items()}
        scaler = ctrl.config.autoscaler
        autoscaler = {
            "enabled": scaler.enabled,
            "interval_s": scaler.interval_s,
            "latency": {"quantile": scaler.latency_quantile, "ttft_s": self.latency["ttft"], "itl_s": self.latency["itl"]},
            "pressure": {role: pool.autoscaler.last_pressure for role, pool in ctrl.pools.items()},
            "mode": scaler.adaptive.mode,
        }
        if ctrl.policy is not None:
            autoscaler["adaptive"] = {"reasons": list(ctrl.policy.last.reasons), "pressure": ctrl.policy.last.pressure}
        return {"router": router, "pools": pools, "autoscaler": autoscaler, "events": list(ctrl.events)[-10:],
                "security": ctrl.authentication}

    async def _router_status(self) -> tuple[dict[str, Any], dict[str, dict]]:
        """(the router's part of the report, the workers registered with it by id)."""
        ctrl = self.controller
        router: dict[str, Any] = {**ctrl.endpoints(), "address": ctrl.router_info.get("address"),
                                  "node_ip": ctrl.router_info.get("node_ip"), "health": "unhealthy"}
        try:
            view, summary = await asyncio.gather(wait_ref(ctrl.router.pool_view.remote(), 5), wait_ref(ctrl.router.summary.remote(), 5))
        except Exception as exc:  # noqa: BLE001
            router["error"] = repr(exc)
            return router, {}
        router.update(summary)
        router["health"] = "draining" if summary["draining"] else "healthy"
        router["registered_workers"] = len(view)
        return router, {w["worker_id"]: w for w in view}


def _spawn(operation) -> None:
    """Run a pool operation the monitor does not wait for; its failure is logged (the next tick sees the pools as they are)."""
    task = asyncio.create_task(operation)
    task.add_done_callback(lambda t: t.cancelled() or t.exception() is None or log.warning("controller action failed: %r", t.exception()))

"""The pdserve controller: a named Ray actor (`controller` in namespace `pdserve`) that owns the
router and both worker pools, and answers `pdserve status|scale|down`.

Lifecycle:
  `start()`     router actor first (its own placement group), then each pool's `replicas` workers
                (one placement group + one actor per worker); returns the router's endpoints once
                every worker registered with the router. Then the monitor (deploy/monitor.py) ticks
                every interval: workers' Stats, lost workers replaced (back to the pool's target),
                the autoscaler's or the adaptive policy's plans, which it asks this controller to carry out.
  `scale(role, n)`  up: new placement group + worker actor, wait until the router lists it as
                healthy; down: pick the least loaded workers, drain them (Deregister from the
                router, wait for requests in flight to finish), kill the actor, remove its group.
                No request fails either way. One scale at a time per pool.
  `switch_role(worker, role)`  the worker actor switches role in place (drain, deregister,
                re-register); its slot moves to the other pool. One pool operation at a time.
  `status()`    router, pools and workers with health and load (the `pdserve status` JSON, deploy/monitor.py;
                also over loopback HTTP for the CLI on this machine, deploy/status_endpoint.py);
                `events_since(t)` the events after unix time t (a poller's read).
  `shutdown()`  router stops admitting and finishes its requests in flight, workers drain and stop,
                router stops, every actor and placement group is removed.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import time
from dataclasses import dataclass
from typing import Any

import ray

from common.config import PdserveConfig
from common.secrets import SECRET_ENV, HandedSecret, generate_secret, secret_source
from deploy.actors import RouterActor, WorkerActor
from deploy.adaptive import AdaptivePolicy
from deploy.autoscaler import PoolAutoscaler
from deploy.monitor import Monitor, refresh_stats
from deploy.placement import Placement, dispose, wait_ref
from deploy.slots import ROLES, Pool, WorkerSlot
from deploy.status_endpoint import StatusEndpoint

log = logging.getLogger(__name__)

CONTROLLER_NAME = "controller"
START_TIMEOUT_S = 600.0
REGISTER_TIMEOUT_S = 60.0
DRAIN_SETTLE_S = 0.5
"""After Deregister, a worker must stay idle this long before it stops (a request routed to it
just before the router forgot it is on the wire for well under this)."""
WILDCARDS = ("0.0.0.0", "::", "")

RemoteRouter = ray.remote(RouterActor)
RemoteWorker = ray.remote(WorkerActor)


@dataclass(frozen=True)
class DeployOptions:
    bind_host: str | None = "127.0.0.1"
    """Host every server binds to; None: each actor's Ray node IP (multi-node clusters)."""
    log_level: str = "WARNING"
    detached: bool = False
    """Actors and placement groups outlive the driver that created them (`pdserve up`)."""


class Controller:
    """Async Ray actor: every method runs on one event loop, so state needs no locks beyond the
    per-pool scale lock (held across the awaits of one scale operation)."""

    def __init__(self, config: PdserveConfig, options: DeployOptions):
        logging.basicConfig(level=options.log_level.upper())
        self.config = config
        self.options = options
        self.router = self.router_pg = None
        self.router_info: dict = {}
        adaptive = config.autoscaler.adaptive.mode == "adaptive"
        self.policy = AdaptivePolicy(config.autoscaler, config.pools, time.monotonic()) if adaptive else None
        self.pools = {role: Pool(role, getattr(config.pools, role), self.policy.scalers[role] if self.policy else
                                 PoolAutoscaler(role, config.autoscaler, getattr(config.pools, role))) for role in ROLES}
        self.events: collections.deque[dict] = collections.deque(maxlen=50)
        self._ids = itertools.count()
        self._monitor_task: asyncio.Task | None = None
        self._router_task: asyncio.Task | None = None
        self.stopping = False
        self.placement = Placement(options.detached)
        self.monitor = Monitor(self)
        self.status_endpoint: StatusEndpoint | None = None
        self._secret, self.authentication = deployment_secret(config)

    # ---- lifecycle ------------------------------------------------------------------------------
    async def start(self) -> dict:
        # workers' processes start (and import torch) while the router starts; they register once it is up
        self._router_task = asyncio.create_task(self._start_router())
        results = await asyncio.gather(*(self._scale_to(pool, pool.config.replicas, "initial") for pool in self.pools.values()))
        errors = [e for r in results for e in r["errors"]]
        await asyncio.wait([self._router_task])
        router_error = self._router_task.exception()
        if router_error is not None or errors:
            await self.shutdown(5.0)  # leave nothing half-started (detached actors would outlive us)
            if router_error is not None:
                raise router_error  # it explains the workers' errors too
            raise RuntimeError("could not start the pools: " + "; ".join(errors))
        self._monitor_task = asyncio.create_task(self.monitor.run())
        await self._open_status_endpoint()
        return self.endpoints()

    async def shutdown(self, grace_s: float = 30.0) -> dict:
        """Drain and stop everything: the router stops admitting, requests in flight finish."""
        self.stopping = True
        if self._monitor_task is not None:
            self._monitor_task.cancel()
        left = 0
        if self.router is not None:
            try:
                left = await wait_ref(self.router.drain.remote(grace_s), grace_s + 10)
            except Exception as exc:  # noqa: BLE001 - a dead router must not block the shutdown
                log.warning("router drain failed: %r", exc)
        slots = [w for pool in self.pools.values() for w in pool.workers.values()]
        await asyncio.gather(*(self._stop_worker(slot, grace_s) for slot in slots))
        for pool in self.pools.values():
            pool.workers.clear()
        if self.router is not None:
            try:
                await wait_ref(self.router.stop.remote(grace_s), grace_s + 10)
            except Exception as exc:  # noqa: BLE001
                log.warning("router stop failed: %r", exc)
            dispose(self.router, self.router_pg)
            self.router = self.router_pg = None
        if self.status_endpoint is not None:
            self.status_endpoint.close()
        return {"stopped_workers": len(slots), "requests_left_in_flight": left}

    async def _open_status_endpoint(self) -> None:
        """`pdserve status` on this machine asks here, without joining Ray (deploy/status_endpoint.py)."""
        endpoint = StatusEndpoint(self.status, ray.get_runtime_context().gcs_address)
        try:
            await endpoint.start()
        except OSError as exc:  # status still answers through Ray
            log.warning("no status endpoint: %r", exc)
            return
        self.status_endpoint = endpoint

    async def ping(self) -> bool:
        return not self.stopping

    async def events_since(self, since: float = 0.0) -> list[dict]:
        """The events kept (the last 50) whose `time` (unix seconds) is after `since`: a poller's cheap read."""
        return [e for e in self.events if e["time"] > since]

    def endpoints(self) -> dict:
        info = self.router_info
        host = info.get("node_ip") if info.get("host") in WILDCARDS else info.get("host")
        return {
            "grpc": f"{host}:{info.get('grpc_port')}",
            "http": f"{'https' if self.config.security.tls_cert_file else 'http'}://{host}:{info.get('http_port')}",
            "grpc_port": info.get("grpc_port"),
            "http_port": info.get("http_port"),
            "internal": info.get("internal_address"),
        }

    # ---- scaling ------------------------------------------------------------------------------
    async def scale(self, role: str, replicas: int) -> dict:
        if role not in self.pools:
            raise ValueError(f"unknown pool {role!r} (pools: {', '.join(ROLES)})")
        pool = self.pools[role]
        lo, hi = pool.config.min_replicas, pool.config.max_replicas
        if not isinstance(replicas, int) or not lo <= replicas <= hi:
            raise ValueError(f"{role}={replicas!r}: must be within pools.{role} [min_replicas, max_replicas] = [{lo}, {hi}]")
        if self.stopping:
            raise RuntimeError("pdserve is shutting down")
        return await self._scale_to(pool, replicas, "manual")

    async def switch_role(self, worker_id: str, role: str) -> dict:
        """`pdserve role`: the worker drains, deregisters, takes `role` and registers again; its slot moves
        to the other pool (both pools' targets follow, within their min/max replicas)."""
        if role not in self.pools:
            raise ValueError(f"role: must be one of {', '.join(ROLES)}, got {role!r}")
        source = next((p for p in self.pools.values() if worker_id in p.workers), None)
        if source is None:
            known = ", ".join(w for p in self.pools.values() for w in p.workers) or "none"
            raise ValueError(f"worker_id: no worker {worker_id!r} in the pools (known: {known})")
        if source.role == role:
            raise ValueError(f"role: the worker is already a {role} worker")
        target = self.pools[role]
        first, second = sorted((source, target), key=lambda pool: ROLES.index(pool.role))  # one lock order: no deadlock
        async with first.lock, second.lock:
            slot = source.workers.get(worker_id)
            if slot is None or slot.state != "ready":
                raise ValueError(f"worker_id: {worker_id!r} is not ready (it is {slot.state if slot else 'gone'})")
            _check_bounds(source, len(source.active()) - 1)
            _check_bounds(target, len(target.active()) + 1)
            slot.state = "switching"
            try:
                result = await wait_ref(slot.actor.switch_role.remote(role), self.config.autoscaler.drain_timeout_s + 60)
            finally:
                slot.state = "ready"
            source.workers.pop(worker_id)
            slot.role, target.workers[worker_id] = role, slot
            source.target, target.target = len(source.active()), len(target.active())
            self.events.append({"time": time.time(), "pool": role, "from": source.role, "to": role, "worker_id": worker_id,
                                "reason": f"role switch of {worker_id}, drained in {result['drain_s']:.2f} s"})
            log.warning("worker %s: %s -> %s (drained in %.2f s)", worker_id, source.role, role, result["drain_s"])
            return result

    async def _scale_to(self, pool: Pool, n: int, reason: str) -> dict:
        async with pool.lock:
            before = len(pool.active())
            pool.target = n
            added: list[str] = []
            removed: list[dict] = []
            errors: list[str] = []
            if n > before:
                results = await asyncio.gather(*(self._add_worker(pool) for _ in range(n - before)), return_exceptions=True)
                added = [r for r in results if isinstance(r, str)]
                errors = [f"{pool.role}: {r}" for r in results if isinstance(r, BaseException)]
            elif n < before:
                victims = await self._pick_victims(pool, before - n)
                removed = list(await asyncio.gather(*(self._drain_worker(pool, slot) for slot in victims)))
            after = len(pool.active())
            if errors:
                pool.target = after  # keep what was reached; the monitor must not retry a failing scale-up forever
            if after != before:
                pool.autoscaler.record_change(before, after)
            event = {"time": time.time(), "pool": pool.role, "from": before, "to": after, "reason": reason,
                     "added": added, "removed": removed, "errors": errors}
            if after != before or errors:
                self.events.append(event)
                log.warning("pool %s: %d -> %d workers (%s)%s", pool.role, before, after, reason,
                            f"; errors: {errors}" if errors else "")
            return {"role": pool.role, "replicas": after, **{k: event[k] for k in ("added", "removed", "errors")}}

    async def _add_worker(self, pool: Pool) -> str:
        worker_id = f"{pool.role}-{next(self._ids)}"
        slot = pool.workers[worker_id] = WorkerSlot(worker_id, pool.role)
        cfg = pool.config
        try:
            bundle = self.placement.bundle(cfg.num_cpus, cfg.num_gpus, cfg.resources)
            slot.pg = await self.placement.group(worker_id, bundle, cfg.placement_strategy, cfg.tensor_parallel_size)
            if self.stopping:
                raise RuntimeError("pdserve is shutting down")
            slot.actor = RemoteWorker.options(**self.placement.actor_options(worker_id, slot.pg), max_concurrency=8).remote(
                pool.role, self.config, worker_id, self.options.bind_host, self.options.log_level, self._secret
            )
            await self._router_task  # the router's address (raises if the router failed)
            slot.info = await wait_ref(slot.actor.start.remote(self.router_info["internal_address"]), START_TIMEOUT_S)
            await self._wait_registered(worker_id)
            slot.state = "ready"
            log.info("worker %s ready at %s", worker_id, slot.info.get("address"))
            return worker_id
        except BaseException:
            pool.workers.pop(worker_id, None)
            dispose(slot.actor, slot.pg)
            raise

    async def _pick_victims(self, pool: Pool, k: int) -> list[WorkerSlot]:
        """The k least loaded workers (newest first on ties): their drain is the shortest."""
        candidates = pool.active()
        await refresh_stats(candidates)

        def load(slot: WorkerSlot) -> tuple:
            s = slot.stats or {}
            busy = s.get("in_flight", 0) + s.get("running_requests", 0) + s.get("queued_requests", 0)
            return (slot.state == "ready", busy, -slot.created)  # never-ready (starting) ones go first

        return sorted(candidates, key=load)[:k]

    async def _drain_worker(self, pool: Pool, slot: WorkerSlot) -> dict:
        slot.state = "draining"
        timeout = self.config.autoscaler.drain_timeout_s
        try:
            if slot.actor is None:
                return {"worker_id": slot.worker_id, "in_flight_at_drain": 0}
            return await wait_ref(slot.actor.drain.remote(DRAIN_SETTLE_S, timeout), timeout + 60)
        except Exception as exc:  # noqa: BLE001 - a worker that died while draining is gone anyway
            return {"worker_id": slot.worker_id, "error": repr(exc)}
        finally:
            pool.workers.pop(slot.worker_id, None)
            dispose(slot.actor, slot.pg)

    async def _stop_worker(self, slot: WorkerSlot, grace_s: float) -> None:
        slot.state = "draining"
        try:
            if slot.actor is not None:
                await wait_ref(slot.actor.stop.remote(grace_s), grace_s + 10)
        except Exception as exc:  # noqa: BLE001
            log.warning("worker %s did not stop cleanly: %r", slot.worker_id, exc)
        finally:
            dispose(slot.actor, slot.pg)

    async def _start_router(self) -> None:
        cfg = self.config.router
        bind = cfg.host if cfg.host in WILDCARDS else self.options.bind_host
        self.router_pg = await self.placement.group("router", self.placement.bundle(cfg.num_cpus, 0, cfg.resources), "PACK")
        self.router = RemoteRouter.options(**self.placement.actor_options("router", self.router_pg), max_concurrency=8).remote(
            self.config, bind, self.options.log_level, self._secret
        )
        try:
            info = await wait_ref(self.router.start.remote(), START_TIMEOUT_S)
        except BaseException:
            dispose(self.router, self.router_pg)
            self.router = self.router_pg = None
            raise
        host = info["address"].rsplit(":", 1)[0]
        internal = info["internal_address"].rsplit(":", 1)[0]
        self.router_info = {**info, "host": host, "address": f"{info['node_ip'] if host in WILDCARDS else host}:{info['grpc_port']}",
                            "internal_address": f"{info['node_ip'] if internal in WILDCARDS else internal}:{info['internal_port']}"}

    async def _wait_registered(self, worker_id: str) -> None:
        deadline = time.monotonic() + REGISTER_TIMEOUT_S
        while time.monotonic() < deadline:
            view = await wait_ref(self.router.pool_view.remote(), 10)
            if any(w["worker_id"] == worker_id and w["healthy"] for w in view):
                return
            await asyncio.sleep(0.1)
        raise TimeoutError(f"{worker_id} did not register with the router within {REGISTER_TIMEOUT_S:.0f} s")

    # ---- status -----------------------------------------------------------------------------
    async def status(self) -> dict:
        return await self.monitor.status()


def _check_bounds(pool: Pool, n: int) -> None:
    lo, hi = pool.config.min_replicas, pool.config.max_replicas
    if not lo <= n <= hi:
        raise ValueError(f"role: the switch would leave pools.{pool.role} with {n} workers, outside [min_replicas, max_replicas] = [{lo}, {hi}]")


def deployment_secret(config: PdserveConfig) -> tuple[HandedSecret | None, dict[str, Any]]:
    """The secret to hand to the actors (None: a configured one, which each actor resolves itself;
    else a fresh one for this deployment) and how the deployment is authenticated (for `status`)."""
    sec = config.security
    configured, source = secret_source(sec.shared_secret, sec.shared_secret_file)
    where = source if source == SECRET_ENV else f"security.{source}"
    handed = None if configured else HandedSecret(generate_secret())
    return handed, {"authenticated": True, "secret": f"configured ({where})" if configured else "generated for this deployment",
                    "tls": bool(sec.tls_cert_file)}

"""The Ray actors that host pdserve's servers: one router, one actor per prefill/decode worker.

Each actor owns a `ServerThread` (deploy/hosting.py) that runs the unchanged server coroutine
(`router.main.serve`, `prefill_worker.main.serve` / `decode_worker.main.serve`) on its own event loop in a thread of the actor
process; the actor's methods (called by the controller, in Ray's threads) reach into that loop.

Lifecycle of a worker actor (created by the controller in its own placement group):
  `start(router)`  build the engine (torch threads = the pool's CPU share), bind gRPC (+ KV receiver),
             register with the router (heartbeats carry Stats); returns the ready info
  `stats()`  the worker's `Stats` plus requests in flight
  `switch_role(role)`  drain, deregister, take the other role over the same engine, register again
             (`pdserve role` through the controller; pools that are not tensor-parallel run role workers)
  `drain()`  scale-down: Deregister from the router first (nothing new is routed here), wait
             until no request has been in flight for `settle_s`, then stop the server
  `stop()`   drain and stop (shutdown; the router has already stopped admitting)
The controller kills the actor and removes its placement group afterwards.

Security (common/security.py): a configured secret is resolved by each actor itself (YAML value,
`shared_secret_file` on its node, or PDSERVE_SHARED_SECRET in the environment Ray gave it), and
TLS files are read on its node. With none configured, the controller generates one per deployment
and hands it to every actor as a constructor argument (`HandedSecret`, whose repr hides it): never
on a command line, in the environment, in runtime_env (which Ray shows in its dashboard and logs
in runtime_env_setup logs) or in the config.

The router actor: `start()`, `pool_view()` (its registry: who is registered and healthy),
`latency_buckets()` (TTFT / ITL histograms for the autoscaler), `summary()`,
`set_local_prefill_threshold()` (the adaptive controller), `drain()` (stop admitting, wait for
requests in flight), `stop()`.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import logging
import os
import time
from typing import Any

import ray

from common.config import PdserveConfig
from common.role_switch import ROLE_NAMES
from common.secrets import HandedSecret
from common.serving import ServerControl, configure_logging, wait_idle
from common.validation import non_negative_int
from deploy.hosting import ServerThread
from deploy.ranks import RayRanks
from proto.pdserve.v1 import pdserve_pb2 as pb

log = logging.getLogger(__name__)


def _setup_process(log_level: str) -> None:
    configure_logging(log_level)
    logging.getLogger().setLevel(log_level.upper())


def _node_ip() -> str:
    return ray.util.get_node_ip_address()


def _worker_serve(role: str, config: PdserveConfig):
    """The worker's `serve` coroutine: a role worker (it can switch role, `switch_role`) when neither pool
    is tensor-parallel, else the plain worker of `role`. Imported here, in the worker actor's process
    only: it loads torch and the engine, which the controller and the CLI (they import this module) must not."""
    if switchable(config):
        from role_worker.main import serve as serve_role

        return functools.partial(serve_role, role)
    if role == "prefill":
        from prefill_worker.main import serve
    else:
        from decode_worker.main import serve
    return serve


def switchable(config: PdserveConfig) -> bool:
    """Whether the pools' workers can switch role (role_worker/ refuses tensor parallelism)."""
    return config.pools.prefill.tensor_parallel_size == config.pools.decode.tensor_parallel_size == 1


def _stats_dict(message) -> dict[str, Any]:
    """The scalar fields (the controller's signals); repeated ones (cached_block_hashes: the router's KV index) stay out."""
    return {f.name: getattr(message, f.name) for f in message.DESCRIPTOR.fields if not f.is_repeated}


class WorkerActor:
    def __init__(self, role: str, config: PdserveConfig, worker_id: str, bind_host: str | None, log_level: str = "WARNING",
                 secret: HandedSecret | None = None):
        _setup_process(log_level)
        self._secret = secret.value if secret is not None else ""
        self._serve = _worker_serve(role, config)  # torch + transformers load while the router starts
        self.role, self.worker_id = role, worker_id
        self.host = bind_host or _node_ip()
        # the KV receiver must be reachable from prefill workers on other nodes: same host as gRPC
        self.config = dataclasses.replace(config, kv_transfer=dataclasses.replace(config.kv_transfer, host=self.host))
        self.server: ServerThread | None = None

    def start(self, router_address: str) -> dict[str, Any]:
        """Build the engine, serve, register with the router's internal port at `router_address`;
        the ready info."""
        args = argparse.Namespace(host=self.host, port=0, kv_port=0, router=router_address, rank_launcher=RayRanks.current())

        async def main(control: ServerControl) -> None:
            await self._serve(self.config, args, self.worker_id, control)

        self.server = ServerThread(self.worker_id, main, self._secret)
        info = self.server.start()
        return {**info, "pid": os.getpid(), "node_ip": _node_ip()}

    def stats(self) -> dict[str, Any]:
        service = self.server.handles["roles"].service

        async def read() -> dict[str, Any]:
            stats = _stats_dict(await service.Stats(pb.StatsRequest(), None))
            engine = getattr(service, "engine", None)  # KV held for prompts still prefilling elsewhere: prefill pressure
            waiting = (await engine.stats()).waiting_for_kv_blocks if engine is not None else 0
            return {**stats, "in_flight": service.gate.in_flight, "waiting_for_kv_blocks": waiting}

        return self.server.call(read, timeout_s=10.0)

    def drain(self, settle_s: float = 0.5, timeout_s: float = 300.0) -> dict[str, Any]:
        """Scale-down: leave the router, let requests in flight finish, stop. Returns what happened."""
        roles = self.server.handles["roles"]

        async def leave_and_wait() -> dict[str, Any]:
            started = time.monotonic()
            service = roles.service
            in_flight_at_start = service.gate.in_flight
            await roles.stop()  # Deregister: the router picks us no more
            left = await wait_idle(lambda: service.gate.in_flight, timeout_s=timeout_s, settle_s=settle_s)
            return {"worker_id": self.worker_id, "in_flight_at_drain": in_flight_at_start,
                    "in_flight_left": left, "drain_s": round(time.monotonic() - started, 3)}

        result = self.server.call(leave_and_wait)
        self.server.stop()
        return result

    def switch_role(self, role: str, timeout_s: float = 600.0) -> dict[str, Any]:
        """Drain, deregister, take `role` over the same engine and KV pool, register again
        (common/role_switch.py); what happened. A bad `role` raises RoleSwitchError naming the field."""
        roles = self.server.handles["roles"]
        if len(roles.services) == 1:
            raise ValueError(f"worker_id: {self.worker_id!r} cannot switch role (tensor-parallel pools run plain workers)")
        reply = self.server.call(lambda: roles.switch(role), timeout_s=timeout_s)
        self.role = role
        return {"worker_id": self.worker_id, "previous_role": ROLE_NAMES[reply.previous_role], "role": role,
                "drain_s": round(reply.drain_s, 3), "switch_s": round(reply.switch_s, 3)}

    def stop(self, timeout_s: float = 60.0) -> None:
        if self.server is not None:
            self.server.stop(timeout_s)

    def ping(self) -> bool:
        return self.server is not None and self.server.alive()


class RouterActor:
    def __init__(self, config: PdserveConfig, bind_host: str | None, log_level: str = "WARNING",
                 secret: HandedSecret | None = None):
        _setup_process(log_level)
        host = bind_host or _node_ip()
        # the Registry is for the cluster: on its node's address even when the public port is a wildcard
        internal = config.router.internal_host or (_node_ip() if host in ("0.0.0.0", "::") else host)
        args = argparse.Namespace(host=host, grpc_port=None, http_port=None, internal_host=internal, internal_port=None,
                                  prefill=[], decode=[])

        async def main(control: ServerControl) -> None:
            from router.main import serve  # the router actor's process only (transformers: the tokenizer)

            await serve(config, args, control)

        self.server = ServerThread("router", main, secret.value if secret is not None else "")

    def start(self) -> dict[str, Any]:
        info = self.server.start()
        return {**info, "pid": os.getpid(), "node_ip": _node_ip()}

    def pool_view(self) -> list[dict[str, Any]]:
        pool = self.server.handles["pool"]

        async def read() -> list[dict[str, Any]]:
            now = time.monotonic()
            return [
                {"worker_id": w.worker_id, "role": w.role, "address": w.address, "healthy": w.healthy,
                 "draining": w.draining, "in_flight": w.in_flight, "last_seen_s": round(now - w.last_seen, 3)}
                for w in pool.workers.values()
            ]

        return self.server.call(read, timeout_s=10.0)

    def latency_buckets(self) -> dict[str, list[tuple[float, float]]]:
        """Cumulative (upper bound, count) buckets of the router's TTFT and ITL histograms."""
        metrics = self.server.handles["router"].metrics
        out = {}
        for name, histogram in (("ttft", metrics.ttft), ("itl", metrics.itl)):
            samples = [s for family in histogram.collect() for s in family.samples if s.name.endswith("_bucket")]
            out[name] = [(float(s.labels["le"]), s.value) for s in samples]
        return out

    def summary(self, window_s: float = 60.0) -> dict[str, Any]:
        """Admission, threshold and the critical-path breakdown of the last `window_s` seconds."""
        router = self.server.handles["router"]

        async def read() -> dict[str, Any]:
            return {"draining": router.draining, "in_flight_requests": router.admission.requests,
                    "in_flight_prompt_tokens": router.admission.tokens, "critical_path": router.metrics.critical_path.breakdown(window_s),
                    "local_prefill_threshold": router.orchestrator.local_prefill_threshold,
                    "kv_index": router.pool.kv_index.summary({w.worker_id: w.role for w in router.pool.workers.values()})}

        return self.server.call(read, timeout_s=10.0)

    def set_local_prefill_threshold(self, tokens: int) -> int:
        """Prompts up to `tokens` prefill on their decode worker from now on (0: none); returns the old threshold."""
        non_negative_int("local_prefill_threshold", tokens)
        orchestrator = self.server.handles["router"].orchestrator

        async def swap() -> int:
            old, orchestrator.local_prefill_threshold = orchestrator.local_prefill_threshold, tokens
            return old

        return self.server.call(swap, timeout_s=10.0)

    def drain(self, timeout_s: float = 30.0) -> int:
        """Stop admitting (new requests get UNAVAILABLE) and wait for requests in flight; returns
        how many were still in flight at the timeout."""
        router = self.server.handles["router"]

        async def stop_admitting_and_wait() -> int:
            router.draining = True
            return await wait_idle(lambda: router.admission.requests, timeout_s=timeout_s)

        return self.server.call(stop_admitting_and_wait)

    def stop(self, timeout_s: float = 60.0) -> None:
        self.server.stop(timeout_s)

    def ping(self) -> bool:
        return self.server.alive()

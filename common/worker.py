"""The process both worker packages run: `run_worker` around the parts each worker builds itself.

Lifecycle: parse flags and load the YAML config once (`worker_main`), resolve the cluster
security (a non-loopback bind without a secret is refused unless allowed), set up tracing
(common/tracing.py, off by default), let the worker build its parts (`WorkerParts`: engine, KV
endpoint, servicer; the prefill worker's sender or the decode worker's receiver signs or checks
transfer headers with the cluster secret), bind the gRPC server
(TLS and the secret check of common/security.py when configured), announce the ready line,
optionally register with the router's internal port and heartbeat, serve until SIGTERM, drain
(the servicer's `drain`), deregister, close the parts.
Under Ray (deploy/actors.py) the same `run_worker` runs inside an actor with a `ServerControl`:
the ready info goes to the actor instead of stdout and the actor, not a signal, stops it.
A switchable worker (role_worker/) builds parts for every role over one engine (`WorkerParts.others`):
all their services join the server next to `pdserve.v1.WorkerAdmin`, and common/role_switch.py's
`RoleSwitch` keeps one of them active and registered at a time.

Torch-free on purpose: the parts that load the model are built by prefill_worker/main.py and
decode_worker/main.py and handed in, so this module stays in common/ below both of them.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import grpc

from common.config import PdserveConfig, load_config
from common.registration import RegistrationLoop
from common.role_switch import Register, RoleSwitch, WorkerAdminService
from common.security import InsecureBind, Security
from common.serving import ServerControl, announce_ready, configure_logging, create_server, serve_until_signalled, set_serving
from common.tracing import setup_tracing
from common.validation import ConfigError
from proto.pdserve.v1 import pdserve_pb2_grpc as pb_grpc


@dataclass
class WorkerParts:
    """What a worker builds before it serves."""

    service: Any
    """The servicer: `Stats` (heartbeats carry it), `drain(grace_s)`, `gate` (its `CallGate`: draining, in flight)."""
    service_name: str
    """Its gRPC service, e.g. "pdserve.v1.DecodeWorker" (health, reflection, the secret check)."""
    add_to_server: Callable[[Any, grpc.aio.Server], None]
    close: Callable[[], Awaitable[None]]
    """Stop the KV endpoint and the engine (after the server stopped)."""
    ready: dict[str, Any] = field(default_factory=dict)
    """Extra fields of the ready line (the decode worker's kv_port)."""
    others: dict[str, WorkerParts] = field(default_factory=dict)
    """The other roles a switchable worker can take, by role, over the same engine (their `close` is not
    called: this part's closes everything)."""


BuildParts = Callable[[PdserveConfig, argparse.Namespace, str, Security], Awaitable[WorkerParts]]
Serve = Callable[[PdserveConfig, argparse.Namespace, str], Awaitable[None]]


def parse_args(role: str, argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog=f"python -m {role}_worker", description=f"pdserve {role} worker")
    parser.add_argument("-c", "--config", default=None, help="YAML config (default: deploy/configs/local.yaml)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="gRPC port (0: any free port)")
    parser.add_argument("--kv-port", type=int, default=0, help="decode: KV receiver port (0: any free port)")
    parser.add_argument("--worker-id", default=None)
    parser.add_argument("--router", default=None, help="the router's internal HOST:PORT (its ready line's "
                        "internal_address) to register with")
    parser.add_argument("--log-level", default=os.environ.get("PDSERVE_LOG_LEVEL", "INFO"))
    parser.set_defaults(rank_launcher=None)  # what starts tensor-parallel follower ranks (deploy: Ray tasks)
    return parser.parse_args(argv)


def worker_main(role: str, serve: Serve, argv: list[str] | None = None) -> int:
    """`python -m <role>_worker`: flags, logging, config, then `serve` until SIGTERM."""
    args = parse_args(role, argv)
    configure_logging(args.log_level)
    config = load_config(args.config)
    try:
        asyncio.run(serve(config, args, args.worker_id or f"{role}-{uuid.uuid4().hex[:8]}"))
    except (InsecureBind, ConfigError) as exc:
        logging.getLogger(__name__).error("%s", exc)
        return 2
    return 0


async def run_worker(role: str, build: BuildParts, config: PdserveConfig, args: argparse.Namespace, worker_id: str,
                     control: ServerControl | None = None) -> None:
    security = Security.from_config(config.security, control.handed_secret if control is not None else "")
    hosts = [args.host, *([config.kv_transfer.host] if role == "decode" else [])]
    security.require_secret_for(hosts, config.security.allow_unauthenticated, f"{role} worker {worker_id}")
    parts = None
    stop_tracing = setup_tracing(config.tracing, role, worker_id)
    try:
        parts = await build(config, args, worker_id, security)
        every = {role: parts, **parts.others}
        roles = RoleSwitch(role, {name: p.service for name, p in every.items()})
        await _serve(roles, every, args, worker_id, config, security, control)
    finally:
        if parts is not None:
            await parts.close()
        stop_tracing()


async def _serve(roles: RoleSwitch, every: dict[str, WorkerParts], args: argparse.Namespace, worker_id: str, config: PdserveConfig,
                 security: Security, control: ServerControl | None) -> None:
    """Bind the gRPC server with every role's service (and `WorkerAdmin` when there is more than one),
    announce the ready line, register, serve until stopped, drain, deregister."""
    names = [p.service_name for p in every.values()] + (["pdserve.v1.WorkerAdmin"] if len(every) > 1 else [])
    server, port, health_servicer = create_server(args.host, args.port, names, security, protected=names)
    for p in every.values():
        p.add_to_server(p.service, server)
    if len(every) > 1:
        pb_grpc.add_WorkerAdminServicer_to_server(WorkerAdminService(roles, worker_id), server)
    try:
        await server.start()
        await set_serving(health_servicer, names, True)
        address = f"{args.host}:{port}"
        ready = {"role": roles.role, "worker_id": worker_id, "grpc_port": port, "address": address,
                 **({"roles": sorted(every)} if len(every) > 1 else {})}
        for p in every.values():
            ready.update(p.ready)
        roles.start(_registering(args, worker_id, address, config, security))
        if control is None:
            announce_ready(**ready)
        else:
            control.ready(ready, roles=roles)
        await serve_until_signalled(server, health_servicer, names, roles.drain, stop=control.stop if control is not None else None)
    finally:
        await roles.stop()


def _registering(args: argparse.Namespace, worker_id: str, address: str, config: PdserveConfig, security: Security) -> Register | None:
    """What registers a role with the router (`--router`), or None."""
    if not args.router:
        return None

    def register(role: str, service: Any) -> RegistrationLoop:
        loop = RegistrationLoop(args.router, role, worker_id, address, service, config.model_name, security)
        loop.start()
        return loop

    return register


def lose_worker(error: Exception) -> None:
    """The worker cannot serve any more (its engine lost a tensor-parallel rank): exit at once, as a
    crash would, so the router migrates its requests and the controller replaces it as a whole."""
    logging.getLogger(__name__).critical("worker lost: %s; exiting", error)
    logging.shutdown()
    os._exit(70)

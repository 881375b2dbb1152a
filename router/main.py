"""`python -m router`: the router process (gRPC Router, internal gRPC Registry, HTTP health/metrics/OpenAI).

Lifecycle: load config; set up tracing (common/tracing.py, off by default); load the tokenizer only (no model weights, no torch: router/tokenizer.py); bind two gRPC planes and HTTP
(TLS when `security.tls_cert_file` is set): the public port serves Router/Generate (API keys),
health and reflection only; the internal port (`router.internal_host`/`internal_port`) serves the
workers' Registry, whose calls must carry the cluster secret when one is set (without one, the
internal plane must be loopback unless `security.allow_unauthenticated`). Add static workers from flags;
expire silent workers every second; print the ready line (`address` public, `internal_address`);
serve until SIGTERM; drain (health NOT_SERVING, refuse new requests, let streams finish); stop.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import socket

import uvicorn

from common.config import PdserveConfig, load_config
from common.security import InsecureBind, Security
from common.serving import ServerControl, announce_ready, configure_logging, create_server, serve_until_signalled, set_serving, wait_idle
from common.tracing import setup_tracing
from proto.pdserve.v1 import pdserve_pb2_grpc as pb_grpc
from router.grpc_api import add_router_to_server
from router.http_app import build_app
from router.metrics import RouterMetrics
from router.pool import WorkerPool
from router.registry_service import RegistryService
from router.service import RouterService
from router.settings import RouterSettings
from router.tokenizer import load_tokenizer_and_context

log = logging.getLogger(__name__)
ROUTER = "pdserve.v1.Router"
REGISTRY = "pdserve.v1.Registry"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m router", description="pdserve router")
    parser.add_argument("-c", "--config", default=None)
    parser.add_argument("--host", default=None)
    parser.add_argument("--grpc-port", type=int, default=None)
    parser.add_argument("--http-port", type=int, default=None)
    parser.add_argument("--internal-host", default=None, help="address of the internal port (Registry); default: router.internal_host, else --host")
    parser.add_argument("--internal-port", type=int, default=None, help="internal gRPC port (0: any free port)")
    parser.add_argument("--prefill", action="append", default=[], metavar="HOST:PORT", help="static prefill worker")
    parser.add_argument("--decode", action="append", default=[], metavar="HOST:PORT", help="static decode worker")
    parser.add_argument("--log-level", default=os.environ.get("PDSERVE_LOG_LEVEL", "INFO"))
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    configure_logging(args.log_level)
    try:
        asyncio.run(serve(load_config(args.config), args))
    except InsecureBind as exc:
        log.error("%s", exc)
        return 2
    return 0


class Planes:
    """The router's two gRPC servers: public (Router, health, reflection: clients, API keys) and
    internal (Registry, health, reflection: the cluster's workers, the cluster secret)."""

    def __init__(self, config: PdserveConfig, args: argparse.Namespace, security: Security, router: RouterService, pool: WorkerPool):
        rc = config.router
        self.host = args.host or rc.host
        self.internal_host = args.internal_host or rc.internal_host or self.host
        # the public plane answers to API keys; what the secret guards is the internal one
        security.require_secret_for([self.internal_host], config.security.allow_unauthenticated, "the router's internal port")
        port = rc.grpc_port if args.grpc_port is None else args.grpc_port
        self.public, self.port, self.health = create_server(self.host, port, [ROUTER], security)
        add_router_to_server(router, self.public)
        internal_port = rc.internal_port if args.internal_port is None else args.internal_port
        self.internal, self.internal_port, self.internal_health = create_server(
            self.internal_host, internal_port, [REGISTRY], security, protected=[REGISTRY])
        pb_grpc.add_RegistryServicer_to_server(RegistryService(pool), self.internal)

    async def start(self) -> None:
        await self.public.start()
        await self.internal.start()
        await set_serving(self.internal_health, [REGISTRY], True)

    def ready_info(self) -> dict:
        return {"grpc_port": self.port, "address": f"{self.host}:{self.port}", "internal_port": self.internal_port,
                "internal_address": f"{self.internal_host}:{self.internal_port}"}


async def serve(config: PdserveConfig, args: argparse.Namespace, control: ServerControl | None = None) -> None:
    """Run the router until SIGTERM (or, embedded in a Ray actor, until `control.stop` is set)."""
    rc = config.router
    security = Security.from_config(config.security, control.handed_secret if control is not None else "")
    stop_tracing = setup_tracing(config.tracing, "router")
    tokenizer, max_len = load_tokenizer_and_context(config.engine.model, config.engine.max_model_len)
    metrics = RouterMetrics()
    pool = WorkerPool(rc.policy, rc.heartbeat_timeout_s, close_grace_s=rc.request_timeout_s, security=security,
                      block_size=config.engine.block_size)
    for i, address in enumerate(args.prefill):
        pool.add(f"prefill-static-{i}", "prefill", address, static=True)
    for i, address in enumerate(args.decode):
        pool.add(f"decode-static-{i}", "decode", address, static=True)
    router = RouterService(RouterSettings.from_config(config, max_len), tokenizer, pool, metrics)
    planes = Planes(config, args, security, router, pool)
    await planes.start()

    http_sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    http_sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    http_sock.bind((planes.host, rc.http_port if args.http_port is None else args.http_port))
    http_sock.listen(2048)  # accept (queue) connections from the moment "ready" is printed, before uvicorn starts
    http = uvicorn.Server(uvicorn.Config(build_app(router), log_level="warning", lifespan="off", **security.uvicorn_ssl()))
    http_task = asyncio.create_task(http.serve(sockets=[http_sock]))

    async def watch_workers() -> None:
        while True:
            pool.expire()
            await pool.refresh_static_stats()
            metrics.observe_workers(pool.workers.values(), pool.kv_index)
            await set_serving(planes.health, [ROUTER], pool.has_role("decode") and not router.draining)
            await asyncio.sleep(0.5)

    watcher = asyncio.create_task(watch_workers())
    ready = {"role": "router", **planes.ready_info(), "http_port": http_sock.getsockname()[1]}
    if control is None:
        announce_ready(**ready)
    else:
        control.ready(ready, router=router, pool=pool)

    async def drain(grace_s: float) -> None:
        router.draining = True
        watcher.cancel()
        await wait_idle(lambda: router.admission.requests)

    try:
        await serve_until_signalled(planes.public, planes.health, [ROUTER], drain, stop=control.stop if control is not None else None)
    finally:
        watcher.cancel()
        http.should_exit = True
        await http_task
        await planes.internal.stop(grace=1.0)
        await router.orchestrator.shadow.close()
        await pool.close()
        stop_tracing()

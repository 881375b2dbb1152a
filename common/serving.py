"""Process lifecycle shared by the router and the workers.

`run_server(...)` starts a grpc.aio server (plus health and reflection), announces readiness as one
JSON line on stdout (`{"event": "ready", ...}`: what tests and launchers wait for), and serves until
SIGTERM/SIGINT. Draining then follows the house rule: health goes NOT_SERVING, the service stops
admitting (`drain()` callback), requests in flight get `grace_s` to finish, then the server stops.
Every drain (router, workers, their Ray actors) waits for its requests with `wait_idle`.

A server hosted inside another process (a Ray actor, deploy/hosting.py) gets a `ServerControl`
instead: its ready info and live objects are handed to the host, and the host stops it by setting
`control.stop` (signals belong to the process's main thread, which is not the server's), and may
hand it the deployment's cluster secret (`control.handed_secret`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from common.security import Security

log = logging.getLogger(__name__)


class ServerControl:
    """Host side of an embedded server: learn when it is ready (info + handles), ask it to stop.

    Created by the host; `stop` must be set on the server's event loop (`request_stop` does that
    from any thread once `bind` was called by the server coroutine). `handed_secret`: the cluster
    secret the host was given (deploy/controller.py generates one when none is configured)."""

    def __init__(self, handed_secret: str = "") -> None:
        self.handed_secret = handed_secret
        self.stop = asyncio.Event()
        self.info: dict[str, Any] = {}
        self.handles: dict[str, Any] = {}
        self.is_ready = threading.Event()
        self.loop: asyncio.AbstractEventLoop | None = None

    def bind(self) -> None:
        self.loop = asyncio.get_running_loop()

    def ready(self, info: dict[str, Any], **handles: Any) -> None:
        self.info, self.handles = dict(info), handles
        self.is_ready.set()

    def request_stop(self) -> None:
        if self.loop is not None and not self.loop.is_closed():
            self.loop.call_soon_threadsafe(self.stop.set)


def create_server(
    host: str, port: int, service_names: list[str], security: Security | None = None, protected: Sequence[str] = ()
) -> tuple[grpc.aio.Server, int, health.aio.HealthServicer]:
    """A grpc.aio server bound to host:port (0 = any free port), with health and reflection.

    With `security`, the port is TLS when a certificate is configured, and calls to the services
    in `protected` must carry the cluster secret (health and reflection always stay open)."""
    security = security or Security()
    server = grpc.aio.server(
        options=[("grpc.max_receive_message_length", 64 << 20), ("grpc.so_reuseport", 0)],
        interceptors=security.server_interceptors(protected),
    )
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection([*service_names, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    bound = security.add_port(server, f"{host}:{port}")
    if bound == 0:
        raise OSError(f"cannot bind gRPC server to {host}:{port}")
    return server, bound, health_servicer


async def set_serving(health_servicer: health.aio.HealthServicer, service_names: list[str], serving: bool) -> None:
    status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
    for name in ["", *service_names]:
        await health_servicer.set(name, status)


READY_MARK = '{"event": "ready"'
_stdout_lock = threading.Lock()


def emit_event(event: dict) -> None:
    """One JSON line on stdout in a single write, whichever thread emits it: stderr often shares the pipe
    (Ray forwards its actors' logs there), and `print` writes the text and its newline separately, so
    another line could land between them."""
    with _stdout_lock:
        sys.stdout.write(json.dumps(event) + "\n")
        sys.stdout.flush()


def announce_ready(**fields) -> None:
    emit_event({"event": "ready", "pid": os.getpid(), **fields})


def parse_ready(line: str) -> dict | None:
    """The ready event in one line of a process's output, or None; text before or after it is ignored."""
    start = line.find(READY_MARK)
    if start < 0:
        return None
    try:
        event, _ = json.JSONDecoder().raw_decode(line, start)
    except json.JSONDecodeError:
        return None
    return event


async def serve_until_signalled(
    server: grpc.aio.Server,
    health_servicer: health.aio.HealthServicer,
    service_names: list[str],
    drain: Callable[[float], Awaitable[None]],
    grace_s: float = 30.0,
    stop: asyncio.Event | None = None,
) -> None:
    """Serve until SIGTERM/SIGINT (or until `stop` is set, for embedded servers), then drain."""
    if stop is None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("draining (grace %.0f s)", grace_s)
    await set_serving(health_servicer, service_names, False)
    try:
        await asyncio.wait_for(drain(grace_s), timeout=grace_s)
    except TimeoutError:
        log.warning("drain grace period over; stopping with requests in flight")
    await server.stop(grace=1.0)


async def wait_idle(in_flight: Callable[[], int], timeout_s: float | None = None, settle_s: float = 0.0,
                    poll_s: float = 0.05) -> int:
    """The second half of a drain, once admission is closed: wait until `in_flight()` is 0 and has
    stayed 0 for `settle_s` (a request routed just before admission closed may still arrive), or
    until `timeout_s` passed (None: no limit). Returns how many requests are still in flight."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    idle_since = None
    while deadline is None or time.monotonic() < deadline:
        now = time.monotonic()
        if in_flight():
            idle_since = None
        elif idle_since is None:
            idle_since = now
        if idle_since is not None and now - idle_since >= settle_s:
            break
        await asyncio.sleep(poll_s)
    return in_flight()


class CallGate:
    """Admission of one worker service's calls: `enter` refuses a call once draining (UNAVAILABLE)
    and counts it in flight until `leave`; `drain` stops admitting and waits until none is left."""

    def __init__(self, role: str):
        self.role = role
        self.draining = False
        self.in_flight = 0

    async def enter(self, context: grpc.aio.ServicerContext) -> None:
        if self.draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"{self.role} worker is draining")
        self.in_flight += 1

    def leave(self) -> None:
        self.in_flight -= 1

    async def drain(self) -> None:
        self.draining = True
        await wait_idle(lambda: self.in_flight)


def configure_logging(level: str = "INFO") -> None:
    logging.basicConfig(
        level=level.upper(), stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )

"""Worker side of the registry: register with the router, heartbeat with stats, re-register when
the router forgets us (router restart), deregister on shutdown. Calls go over the cluster's
internal channel (common/security.py: TLS and the shared secret when configured)."""

from __future__ import annotations

import asyncio
import logging

import grpc

from common.security import Security
from proto.pdserve.v1 import pdserve_pb2 as pb
from proto.pdserve.v1 import pdserve_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)
ROLES = {"prefill": pb.ROLE_PREFILL, "decode": pb.ROLE_DECODE}


class RegistrationLoop:
    def __init__(self, router_address: str, role: str, worker_id: str, address: str, service, model: str,
                 security: Security | None = None):
        self.router_address = router_address
        self.info = pb.WorkerInfo(worker_id=worker_id, role=ROLES[role], address=address, model=model)
        self.service = service
        self.interval_s = 1.0
        self._task: asyncio.Task | None = None
        self._stopped = False
        self.registered = asyncio.Event()
        """Set once the router accepted our Register (a role switch waits for it)."""
        self._channel = (security or Security()).channel(router_address)
        self._stub = pb_grpc.RegistryStub(self._channel)

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        """Stop heartbeating, then deregister (idempotent). The loop is awaited first so that no
        Register of ours can follow the Deregister and re-add us (scale-down relies on it)."""
        if self._stopped:
            return
        self._stopped = True
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        try:
            await self._stub.Deregister(pb.DeregisterRequest(worker_id=self.info.worker_id), timeout=2.0)
        except grpc.aio.AioRpcError:
            pass
        await self._channel.close()

    async def _run(self) -> None:
        registered = False
        while True:
            try:
                if not registered:
                    reply = await self._stub.Register(pb.RegisterRequest(worker=self.info), timeout=5.0)
                    self.interval_s = reply.heartbeat_interval_s or self.interval_s
                    registered = True
                    self.registered.set()
                    log.info("registered with router %s", self.router_address)
                stats = await self.service.Stats(pb.StatsRequest(), None)
                reply = await self._stub.Heartbeat(pb.HeartbeatRequest(worker_id=self.info.worker_id, stats=stats), timeout=5.0)
                registered = reply.known
            except grpc.aio.AioRpcError as exc:
                registered = False
                if exc.code() == grpc.StatusCode.UNAUTHENTICATED:  # misconfigured: say so, not just retry
                    log.warning("router %s refused us: %s (is security.shared_secret the same?)", self.router_address, exc.details())
                elif exc.code() == grpc.StatusCode.ALREADY_EXISTS:  # our id is live at another address
                    log.warning("router %s refused us: %s", self.router_address, exc.details())
                else:
                    log.debug("router %s unreachable: %s", self.router_address, exc.code().name)
            await asyncio.sleep(self.interval_s)

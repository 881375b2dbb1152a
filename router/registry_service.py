"""`pdserve.v1.Registry`: workers register with the router, heartbeat their stats, deregister.

Served on the router's internal port only, behind the cluster secret. Each call updates the
`WorkerPool`, which the policies pick from; a worker whose heartbeats stop is expired by the
router's watcher (`router.main`), not here. A worker id is owned by its address while it is alive:
re-registering it from the same address (a router restart) works, from another one is refused
(ALREADY_EXISTS) until the id has been silent for the heartbeat timeout.
"""

from __future__ import annotations

import time

import grpc

from proto.pdserve.v1 import pdserve_pb2 as pb
from proto.pdserve.v1 import pdserve_pb2_grpc as pb_grpc
from router.pool import Worker, WorkerPool


class RegistryService(pb_grpc.RegistryServicer):
    def __init__(self, pool: WorkerPool, heartbeat_interval_s: float = 1.0):
        self.pool = pool
        self.heartbeat_interval_s = heartbeat_interval_s

    async def Register(self, request: pb.RegisterRequest, context) -> pb.RegisterResponse:
        w = request.worker
        role = {pb.ROLE_PREFILL: "prefill", pb.ROLE_DECODE: "decode"}.get(w.role)
        if role is None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "worker.role: must be ROLE_PREFILL or ROLE_DECODE")
        if not w.worker_id or not w.address:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "worker.worker_id and worker.address are required")
        existing = self.pool.workers.get(w.worker_id)
        if existing is not None and existing.address != w.address and self._alive(existing):
            await context.abort(grpc.StatusCode.ALREADY_EXISTS,
                                f"worker.worker_id: {w.worker_id!r} is registered at another address; a live worker's id "
                                f"cannot be taken over (it is free {self.pool.heartbeat_timeout_s:g} s after its last heartbeat)")
        self.pool.add(w.worker_id, role, w.address)
        return pb.RegisterResponse(heartbeat_interval_s=self.heartbeat_interval_s, heartbeat_timeout_s=self.pool.heartbeat_timeout_s)

    def _alive(self, worker: Worker) -> bool:
        return worker.static or time.monotonic() - worker.last_seen <= self.pool.heartbeat_timeout_s

    async def Heartbeat(self, request: pb.HeartbeatRequest, context) -> pb.HeartbeatResponse:
        known = self.pool.heartbeat(request.worker_id, request.stats if request.HasField("stats") else None)
        return pb.HeartbeatResponse(known=known)

    async def Deregister(self, request: pb.DeregisterRequest, context) -> pb.DeregisterResponse:
        self.pool.remove(request.worker_id)
        return pb.DeregisterResponse()

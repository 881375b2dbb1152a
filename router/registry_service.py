"""`pdserve.v1.Registry`: workers register with the router, heartbeat their stats, deregister.

Served on the router's internal port only, behind the cluster secret. Each call updates the
`WorkerPool`, which the policies pick from; a worker whose heartbeats stop is expired by the
router's watcher (`router.main`), not here. A worker id is owned by its address while it is alive:
re-registering it from the same address (a router restart) works, from another one is refused
(ALREADY_EXISTS) until the id has been silent for the heartbeat timeout.
`SwitchRole` (the `pdserve role` CLI, the controller) finds the worker by id and forwards the call to
its `WorkerAdmin` (a `python -m role_worker` process), which deregisters, drains and re-registers.
Each registration opens a KV epoch (router/kv_index.py): `ReportKVEvents` applies a registered worker's
batches of its current epoch only (NOT_FOUND: unknown worker, FAILED_PRECONDITION: a former epoch);
`KVIndex` shows the index.
"""

from __future__ import annotations

import asyncio
import time

import grpc

from common.registration import ROLES
from proto.pdserve.v1 import pdserve_pb2 as pb
from proto.pdserve.v1 import pdserve_pb2_grpc as pb_grpc
from router.kv_index import StaleEvents
from router.pool import Worker, WorkerPool

TIERS = {pb.KV_TIER_POOL: "pool", pb.KV_TIER_HOST: "host", pb.KV_TIER_DISK: "disk"}


class RegistryService(pb_grpc.RegistryServicer):
    def __init__(self, pool: WorkerPool):
        self.pool = pool
        self.heartbeat_interval_s = pool.heartbeat_interval_s
        self.switch_timeout_s = 600.0
        """A switch waits for the worker's calls in flight to finish."""

    async def SwitchRole(self, request: pb.SwitchRoleRequest, context) -> pb.SwitchRoleResponse:
        worker = self.pool.workers.get(request.worker_id)
        if worker is None:
            known = ", ".join(sorted(self.pool.workers)) or "none"
            await context.abort(grpc.StatusCode.NOT_FOUND, f"worker_id: no worker {request.worker_id!r} is registered (known: {known})")
        if request.role not in (pb.ROLE_PREFILL, pb.ROLE_DECODE):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "role: must be ROLE_PREFILL or ROLE_DECODE")
        channel = self.pool.security.channel(worker.address)  # its own: the worker's entry is replaced during the switch
        try:
            reply = await pb_grpc.WorkerAdminStub(channel).SwitchRole(request, timeout=self.switch_timeout_s)
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
                await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                    f"worker_id: {request.worker_id!r} cannot switch role (start it with python -m role_worker)")
            await context.abort(exc.code(), exc.details() or "role switch failed")
        finally:
            await channel.close()
        if not await self._routes_as(request.worker_id, request.role):
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, f"worker_id: {request.worker_id!r} switched role but did not "
                                f"register again within one heartbeat interval ({self.heartbeat_interval_s:g} s)")
        return reply

    async def _routes_as(self, worker_id: str, role: int) -> bool:
        """Whether the registry holds `worker_id` with `role`, waiting at most one heartbeat interval."""
        deadline = time.monotonic() + self.heartbeat_interval_s
        while True:
            worker = self.pool.workers.get(worker_id)
            if worker is not None and ROLES.get(worker.role) == role:
                return True
            if time.monotonic() > deadline:
                return False
            await asyncio.sleep(0.02)

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
        epoch = self.pool.kv_index.open(w.worker_id)
        return pb.RegisterResponse(heartbeat_interval_s=self.heartbeat_interval_s, heartbeat_timeout_s=self.pool.heartbeat_timeout_s,
                                   epoch=epoch)

    def _alive(self, worker: Worker) -> bool:
        return worker.static or time.monotonic() - worker.last_seen <= self.pool.heartbeat_timeout_s

    async def Heartbeat(self, request: pb.HeartbeatRequest, context) -> pb.HeartbeatResponse:
        epoch = self.pool.heartbeat(request.worker_id, request.stats if request.HasField("stats") else None)
        return pb.HeartbeatResponse(known=epoch is not None, epoch=epoch or 0)

    async def Deregister(self, request: pb.DeregisterRequest, context) -> pb.DeregisterResponse:
        self.pool.remove(request.worker_id)
        return pb.DeregisterResponse()

    async def ReportKVEvents(self, request: pb.KVEventBatch, context) -> pb.KVEventsReply:
        if request.worker_id not in self.pool.workers:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"worker_id: {request.worker_id!r} is not registered")
        runs = []
        for i, event in enumerate(request.events):
            tier = TIERS.get(event.tier)
            if tier is None:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"events[{i}].tier: must be KV_TIER_POOL, KV_TIER_HOST or KV_TIER_DISK")
            runs.append((event.stored, tier, event.block_hashes))
        try:
            wanted = self.pool.kv_index.apply(request.worker_id, request.epoch, request.seq, request.snapshot, runs)
        except StaleEvents as exc:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        return pb.KVEventsReply(snapshot_wanted=wanted)

    async def KVIndex(self, request: pb.KVIndexRequest, context) -> pb.KVIndexReply:
        index = self.pool.kv_index
        reply = pb.KVIndexReply(distinct_blocks=index.distinct_blocks())
        for entry in index.entries():
            if request.worker_id and entry.worker_id != request.worker_id:
                continue
            worker = self.pool.workers.get(entry.worker_id)
            lag = index.lag_s(entry)
            view = reply.workers.add(worker_id=entry.worker_id, role=ROLES.get(worker.role, 0) if worker else 0, epoch=entry.epoch,
                                     exact=entry.exact, blocks=len(entry.blocks()), applied_seq=entry.applied_seq,
                                     missing_batches=entry.missing_batches, lag_s=-1.0 if lag is None else lag,
                                     stored=entry.stored, removed=entry.removed)
            if request.include_hashes:
                view.block_hashes.extend(entry.blocks())
        return reply

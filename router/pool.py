"""The router's view of its workers: who exists, who is healthy, and whom to pick next.

Lifecycle of a worker entry: added from config/flags or by `Registry.Register`; refreshed by
heartbeats (which carry `WorkerStats`); taken out of rotation when heartbeats stop for longer
than the timeout or when a call to it fails with UNAVAILABLE (until its next heartbeat); removed
on `Deregister`. A worker that switched role (common/role_switch.py) deregisters, then registers
again with its new role: a fresh entry with a stub of that role's service. Static workers (from flags) have no heartbeat and are probed with `Stats`.
The pool owns the KV index (router/kv_index.py): a registered worker's blocks are there from its
registration's epoch on, and are dropped whenever it leaves rotation (deregistered, heartbeats
missed, a failed call) and as soon as it misses one heartbeat (the index's lease: two heartbeat intervals,
long before the worker leaves rotation at `heartbeat_timeout_s`); its next heartbeat opens a new epoch,
whose events start with a snapshot. Heartbeats never wait for an engine step (common/registration.py),
so a busy worker keeps its lease.
Each entry owns one channel built by `Security.channel` (TLS and the cluster secret when set).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

import grpc

from common.engine_config import EngineConfig
from common.security import Security
from proto.pdserve.v1 import pdserve_pb2 as pb
from proto.pdserve.v1 import pdserve_pb2_grpc as pb_grpc
from router.kv_index import KVIndex
from router.policy import make_policy

log = logging.getLogger(__name__)


@dataclass
class Worker:
    worker_id: str
    role: str
    address: str
    channel: grpc.aio.Channel
    stub: object
    static: bool = False
    healthy: bool = True
    draining: bool = False
    last_seen: float = field(default_factory=time.monotonic)
    stats: pb.WorkerStats | None = None
    in_flight: int = 0
    routed: int = 0
    """Requests the router has sent here (tie-breaker and observability)."""
    pending_prefill_tokens: int = 0
    """Prompt tokens the router has sent here to compute (cached ones excluded) whose prefill is not done yet."""

    @property
    def load(self) -> float:
        """Outstanding work as the router sees it, refined by the worker's last stats."""
        queued = self.stats.queued_requests + self.stats.running_requests if self.stats else 0
        return self.in_flight + 0.5 * queued


class NoWorkerAvailable(Exception):
    def __init__(self, role: str):
        super().__init__(f"no healthy {role} worker is available")
        self.role = role


class WorkerPool:
    def __init__(self, policy: str = "round_robin", heartbeat_timeout_s: float = 5.0, close_grace_s: float = 300.0,
                 security: Security | None = None, block_size: int = EngineConfig.block_size, heartbeat_interval_s: float = 1.0):
        self.security = security or Security()
        """Builds the channels to workers (TLS, shared secret on every call)."""
        self.heartbeat_interval_s = heartbeat_interval_s
        """How often registered workers heartbeat (told them in RegisterResponse)."""
        self.kv_index = KVIndex(lease_s=2 * heartbeat_interval_s)
        """Which registered worker holds which KV block (fed by `Registry.ReportKVEvents`)."""
        self.policy = make_policy(policy, block_size, self.kv_index)
        """Picks workers; `block_size` (the engine's) shapes the prompt's block hashes."""
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.close_grace_s = close_grace_s
        self.workers: dict[str, Worker] = {}
        self._closing: set[asyncio.Task] = set()

    def add(self, worker_id: str, role: str, address: str, static: bool = False) -> Worker:
        existing = self.workers.get(worker_id)
        if existing is not None and existing.address == address and existing.role == role:
            existing.healthy, existing.last_seen = True, time.monotonic()
            return existing
        if existing is not None:
            self.remove(worker_id)
        channel = self.security.channel(address)
        stub = pb_grpc.PrefillWorkerStub(channel) if role == "prefill" else pb_grpc.DecodeWorkerStub(channel)
        worker = Worker(worker_id, role, address, channel, stub, static=static)
        self.workers[worker_id] = worker
        log.info("worker %s (%s) at %s joined", worker_id, role, address)
        return worker

    def remove(self, worker_id: str) -> None:
        """Take a worker out for good. Calls already in flight to it keep their channel until they end
        (a draining worker finishes them), bounded by `close_grace_s`."""
        worker = self.workers.pop(worker_id, None)
        self.kv_index.close(worker_id)
        if worker is not None:
            log.info("worker %s (%s) left", worker_id, worker.role)
            task = asyncio.get_running_loop().create_task(worker.channel.close(grace=self.close_grace_s))
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)

    def heartbeat(self, worker_id: str, stats: pb.WorkerStats | None) -> int | None:
        """Refresh a registered worker; returns its KV epoch (a new one when it was out of rotation and its
        index entry dropped), or None for a worker the pool does not know."""
        worker = self.workers.get(worker_id)
        if worker is None:
            return None
        worker.last_seen = time.monotonic()
        worker.healthy = True
        epoch = self.kv_index.renew(worker_id)
        if epoch is None:
            epoch = self.kv_index.open(worker_id)
        if stats is not None and stats.ByteSize():
            worker.stats = stats
            worker.draining = stats.draining
        return epoch

    def expire(self) -> None:
        """Drop the KV index entries of workers that missed a heartbeat; take workers whose heartbeats stopped
        out of rotation."""
        for worker_id in self.kv_index.lapse():
            log.warning("worker %s missed a heartbeat: its KV index entry is dropped until it sends a snapshot", worker_id)
        now = time.monotonic()
        for worker in self.workers.values():
            if not worker.static and worker.healthy and now - worker.last_seen > self.heartbeat_timeout_s:
                log.warning("worker %s missed heartbeats for %.1f s: out of rotation", worker.worker_id, now - worker.last_seen)
                worker.healthy = False
                self.kv_index.close(worker.worker_id)

    def mark_failed(self, worker: Worker) -> None:
        worker.healthy = False
        worker.last_seen = time.monotonic()
        self.kv_index.close(worker.worker_id)

    def candidates(self, role: str, exclude: set[str] = frozenset()) -> list[Worker]:
        return [w for w in self.workers.values() if w.role == role and w.healthy and not w.draining and w.worker_id not in exclude]

    def pick(self, role: str, prompt_ids: list[int], exclude: set[str] = frozenset()) -> Worker:
        candidates = self.candidates(role, exclude)
        if not candidates:
            raise NoWorkerAvailable(role)
        worker = self.policy.choose(role, candidates, prompt_ids)
        worker.routed += 1
        return worker

    def pull_source(self, puller: Worker, prompt_ids: list[int]) -> pb.KVSource | None:
        """The healthy worker whose pool holds more of the prompt's leading blocks than `puller` has (pool
        or tier) and the most of any, by the KV index: where `puller` may pull them from (kvtransfer.prefix)."""
        block_size = self.policy.block_size
        hashes = self.policy.prompt_hashes(prompt_ids)
        own = self.kv_index.usable_blocks(puller.worker_id, hashes)
        holders = [(self.kv_index.leading_blocks(w.worker_id, hashes), w) for w in self.workers.values()
                   if w is not puller and w.healthy and not w.draining]
        held, holder = max(holders, key=lambda pair: pair[0], default=(0, None))
        if holder is None or held <= own:
            return None
        return pb.KVSource(worker_id=holder.worker_id, address=holder.address, num_tokens=held * block_size,
                           role=pb.ROLE_DECODE if holder.role == "decode" else pb.ROLE_PREFILL)

    async def refresh_static_stats(self, timeout_s: float = 2.0) -> None:
        """Workers given by address have no heartbeat: poll their Stats (and health) instead."""
        for worker in [w for w in self.workers.values() if w.static]:
            try:
                worker.stats = await worker.stub.Stats(pb.StatsRequest(), timeout=timeout_s)
                worker.healthy, worker.draining = True, worker.stats.draining
            except grpc.aio.AioRpcError as exc:
                # a worker in the middle of a long step answers late: busy, not gone
                if exc.code() != grpc.StatusCode.DEADLINE_EXCEEDED:
                    worker.healthy = False

    def has_role(self, role: str) -> bool:
        return bool(self.candidates(role))

    async def close(self) -> None:
        for worker in list(self.workers.values()):
            await worker.channel.close()
        self.workers.clear()
        for task in list(self._closing):
            task.cancel()

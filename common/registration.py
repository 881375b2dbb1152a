"""Worker side of the registry: register with the router, heartbeat with stats, re-register when
the router forgets us (router restart), deregister on shutdown. Calls go over the cluster's
internal channel (common/security.py: TLS and the shared secret when configured).

Beside the heartbeat, `KVEventReporter` sends the engine's prefix-cache changes (blocks stored and
evicted, common/block_hash.py) to the router's KV index: numbered batches of the registration's
epoch (RegisterResponse.epoch; a heartbeat may announce a new one), a snapshot of the whole cache
first and after any failed send or a gap the router saw, then a batch as soon as events are pending
(the loop looks every `TICK_S`; one batch in flight at a time), and at least one per heartbeat interval.
The index trails a worker's cache by about a tick plus the engine step that made the change: a
conversation's next turn finds its earlier turn's blocks even when it follows within a second.

Heartbeats keep time whatever the engine does: the router's KV index drops a worker's entry when one
heartbeat is missed. The stats they carry are read between engine steps, so a heartbeat waits for fresh
ones at most half an interval and otherwise carries the last ones read (a step older).
"""

from __future__ import annotations

import asyncio
import logging
import time

import grpc

from common.block_hash import BlockEvents
from common.security import Security
from proto.pdserve.v1 import pdserve_pb2 as pb
from proto.pdserve.v1 import pdserve_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)
ROLES = {"prefill": pb.ROLE_PREFILL, "decode": pb.ROLE_DECODE}
TIERS = {"pool": pb.KV_TIER_POOL, "host": pb.KV_TIER_HOST, "disk": pb.KV_TIER_DISK}
TICK_S = 0.1
"""How often the loop looks whether a heartbeat or a batch of KV events is due."""


class KVEventReporter:
    """Sends one engine's KV events to the router, numbered per registration epoch."""

    def __init__(self, engine, worker_id: str, stub: pb_grpc.RegistryStub):
        """`engine`: has `kv_events(snapshot)` (a BlockEvents) and `pending_kv_events` (engine.AsyncEngine)."""
        self.engine = engine
        self.worker_id = worker_id
        self.stub = stub
        self.epoch = 0
        self.seq = 0
        self.snapshot_due = True
        self.sent_at = float("-inf")

    def begin(self, epoch: int) -> None:
        """The router's current epoch for us; a new one starts the numbering again with a snapshot."""
        if epoch != self.epoch:
            self.epoch, self.seq, self.snapshot_due = epoch, 0, True

    def due(self, interval_s: float) -> bool:
        if not self.epoch:
            return False  # a router without a KV index
        return self.snapshot_due or self.engine.pending_kv_events > 0 or time.monotonic() - self.sent_at >= interval_s

    async def send(self) -> None:
        """Drain and send one batch; a failed send makes the next one a snapshot (the router may or may
        not have applied it) and raises."""
        tiers: list[BlockEvents] = await self.engine.kv_events(snapshot=self.snapshot_due)
        self.seq += 1
        self.sent_at = time.monotonic()
        batch = pb.KVEventBatch(worker_id=self.worker_id, epoch=self.epoch, seq=self.seq, snapshot=any(e.snapshot for e in tiers))
        for events in tiers:
            for stored, hashes in events.runs:
                batch.events.add(stored=stored, tier=TIERS[events.tier], block_hashes=hashes)
        self.snapshot_due = True
        reply = await self.stub.ReportKVEvents(batch, timeout=5.0)
        self.snapshot_due = reply.snapshot_wanted


class RegistrationLoop:
    def __init__(self, router_address: str, role: str, worker_id: str, address: str, service, model: str,
                 security: Security | None = None):
        self.router_address = router_address
        self.info = pb.WorkerInfo(worker_id=worker_id, role=ROLES[role], address=address, model=model)
        self.service = service
        self.interval_s = 1.0
        self._task: asyncio.Task | None = None
        self._stats: pb.WorkerStats | None = None
        self._stats_call: asyncio.Future | None = None
        """The Stats read in flight (it waits for the engine's step to end)."""
        self._kv_send: asyncio.Future | None = None
        """The KV batch in flight: sent beside the heartbeats, which never wait for it (a batch waits for the
        engine's step to end, and so does the heartbeat's Stats: in one loop a long step would count twice)."""
        self._stopped = False
        self.registered = asyncio.Event()
        """Set once the router accepted our Register (a role switch waits for it)."""
        self._channel = (security or Security()).channel(router_address)
        self._stub = pb_grpc.RegistryStub(self._channel)
        engine = getattr(service, "engine", None)
        self.kv_events = KVEventReporter(engine, worker_id, self._stub) if hasattr(engine, "kv_events") else None

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
        for call in (self._kv_send, self._stats_call):
            if call is not None:
                call.cancel()
                await asyncio.gather(call, return_exceptions=True)
        try:
            await self._stub.Deregister(pb.DeregisterRequest(worker_id=self.info.worker_id), timeout=2.0)
        except grpc.aio.AioRpcError:
            pass
        await self._channel.close()

    async def _run(self) -> None:
        registered = False
        next_beat = 0.0
        while True:
            try:
                if not registered:
                    reply = await self._stub.Register(pb.RegisterRequest(worker=self.info), timeout=5.0)
                    self.interval_s = reply.heartbeat_interval_s or self.interval_s
                    registered = True
                    self._begin_epoch(reply.epoch)
                    self.registered.set()
                    log.info("registered with router %s", self.router_address)
                if time.monotonic() >= next_beat:
                    next_beat = time.monotonic() + self.interval_s
                    stats = await self._latest_stats(self.interval_s / 2)
                    reply = await self._stub.Heartbeat(pb.HeartbeatRequest(worker_id=self.info.worker_id, stats=stats), timeout=5.0)
                    registered = reply.known
                    self._begin_epoch(reply.epoch)
                self._check_kv_send()
                if registered and self.kv_events is not None and self._kv_send is None and self.kv_events.due(self.interval_s):
                    self._kv_send = asyncio.ensure_future(self.kv_events.send())
                await asyncio.sleep(TICK_S)
                continue
            except grpc.aio.AioRpcError as exc:
                registered = False
                if exc.code() == grpc.StatusCode.UNAUTHENTICATED:  # misconfigured: say so, not just retry
                    log.warning("router %s refused us: %s (is security.shared_secret the same?)", self.router_address, exc.details())
                elif exc.code() == grpc.StatusCode.ALREADY_EXISTS:  # our id is live at another address
                    log.warning("router %s refused us: %s", self.router_address, exc.details())
                elif exc.code() in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.NOT_FOUND):  # KV events of a replaced registration
                    log.info("router %s refused our KV events: %s; registering again", self.router_address, exc.details())
                else:
                    log.debug("router %s unreachable: %s", self.router_address, exc.code().name)
            next_beat = 0.0
            await asyncio.sleep(self.interval_s)

    async def _latest_stats(self, wait_s: float) -> pb.WorkerStats | None:
        """Fresh stats if the engine answers within `wait_s`, else the last ones read (None before the first)."""
        if self._stats_call is None:
            self._stats_call = asyncio.ensure_future(self.service.Stats(pb.StatsRequest(), None))
        await asyncio.wait([self._stats_call], timeout=wait_s)
        if self._stats_call.done():
            done, self._stats_call = self._stats_call, None
            self._stats = done.result()
        return self._stats

    def _check_kv_send(self) -> None:
        """A finished KV batch: forget it; a refusal by the router is raised into the loop (which registers
        again), any other failure is logged and the next batch is a snapshot: heartbeats never stop over it."""
        if self._kv_send is None or not self._kv_send.done():
            return
        done, self._kv_send = self._kv_send, None
        error = None if done.cancelled() else done.exception()
        if isinstance(error, grpc.aio.AioRpcError):
            raise error
        if error is not None:
            log.error("sending KV events failed (the next batch is a snapshot): %r", error)
            self.kv_events.snapshot_due = True

    def _begin_epoch(self, epoch: int) -> None:
        if self.kv_events is not None:
            self.kv_events.begin(epoch)

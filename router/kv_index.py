"""The router's global KV index: which registered worker holds which KV block, in which tier.

Lifecycle of a worker's entry: `open` when it registers (a fresh epoch, no blocks, inexact);
each heartbeat `renew`s its lease (`lease_s`: the pool gives two heartbeat intervals, so one missed
heartbeat); an entry whose lease ran out counts for nothing at once (every query skips it) and `lapse`
drops it; its first batch of KV events is a snapshot of its cache (exact from then on); each later batch
(`apply`, numbered 1, 2, ... per epoch) adds the blocks it stored and drops those it evicted; `close`
when it deregisters, misses its heartbeats or fails a call (out of rotation), and `open` again
(a new epoch) on its next registration or heartbeat. Events that name an epoch other than the
worker's current one are refused (`StaleEvents`): a dead or restarted worker's blocks are never
routed by.

Exactness: a batch arriving out of order (a gap: one was lost) is not applied; the entry turns
inexact and the reply asks the worker for a snapshot, which replaces the entry. A duplicate
(seq already applied) is ignored. At quiescence every entry equals its worker's cache.

Blocks are named by common/block_hash.py's chained hashes, so `leading_blocks(worker, hashes)` of
a prompt's chain is how many of its first blocks the worker can use with no compute and no transfer.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from common.block_hash import TIER_POOL

Run = tuple[bool, str, Sequence[int]]
"""(stored?, tier, block hashes): one run of a batch, applied in order."""


class StaleEvents(Exception):
    """Events of a worker that is not registered, or of one of its former registrations."""

    def __init__(self, field_name: str, message: str):
        super().__init__(f"{field_name}: {message}")
        self.field = field_name


@dataclass
class WorkerBlocks:
    """One registration's view: its blocks per tier and how far its event stream got."""

    worker_id: str
    epoch: int
    opened_at: float
    lease_until: float = float("inf")
    """The entry counts until then: a heartbeat of the worker renews it."""
    tiers: dict[str, set[int]] = field(default_factory=dict)
    applied_seq: int = 0
    exact: bool = False
    """A snapshot arrived and no batch after it is known missing."""
    missing_batches: int = 0
    applied_at: float | None = None
    stored: int = 0
    removed: int = 0

    def blocks(self, tier: str = TIER_POOL) -> set[int]:
        return self.tiers.get(tier, set())

    def apply(self, runs: Iterable[Run]) -> None:
        for stored, tier, hashes in runs:
            blocks = self.tiers.setdefault(tier, set())
            if stored:
                blocks.update(hashes)
                self.stored += len(hashes)
            else:
                blocks.difference_update(hashes)
                self.removed += len(hashes)


class KVIndex:
    def __init__(self, clock: Callable[[], float] = time.monotonic, lease_s: float = float("inf")):
        self._clock = clock
        self.lease_s = lease_s
        """How long an entry counts after its registration or its worker's last heartbeat."""
        self._workers: dict[str, WorkerBlocks] = {}
        # epochs grow across router restarts too: a worker's old epoch is never issued again
        self._epochs = itertools.count(time.time_ns())

    # ---- registrations -------------------------------------------------------------------------
    def open(self, worker_id: str) -> int:
        """A new registration of `worker_id`: its former entry is dropped; returns the new epoch."""
        epoch = next(self._epochs)
        now = self._clock()
        self._workers[worker_id] = WorkerBlocks(worker_id, epoch, now, lease_until=now + self.lease_s)
        return epoch

    def renew(self, worker_id: str) -> int | None:
        """The worker is alive (a heartbeat): its entry counts for another `lease_s`. Returns its epoch, or
        None when it has no entry (or its lease had run out: then the entry is dropped here)."""
        entry = self._live(worker_id)
        if entry is None:
            self.close(worker_id)
            return None
        entry.lease_until = self._clock() + self.lease_s
        return entry.epoch

    def lapse(self) -> list[str]:
        """Drop the entries whose lease ran out (their workers missed a heartbeat); returns their worker ids."""
        now = self._clock()
        lapsed = [w for w, entry in self._workers.items() if entry.lease_until < now]
        for worker_id in lapsed:
            self.close(worker_id)
        return lapsed

    def close(self, worker_id: str) -> None:
        """Forget the worker's blocks now (deregistered, dead, out of rotation)."""
        self._workers.pop(worker_id, None)

    def epoch(self, worker_id: str) -> int | None:
        entry = self._live(worker_id)
        return entry.epoch if entry is not None else None

    def _live(self, worker_id: str) -> WorkerBlocks | None:
        """The worker's entry while its lease holds."""
        entry = self._workers.get(worker_id)
        return entry if entry is not None and entry.lease_until >= self._clock() else None

    # ---- events --------------------------------------------------------------------------------
    def apply(self, worker_id: str, epoch: int, seq: int, snapshot: bool, runs: Iterable[Run]) -> bool:
        """Apply one batch of the worker's events; returns whether the router wants a snapshot next.
        Raises StaleEvents for an unknown worker or a former epoch."""
        entry = self._live(worker_id)
        if entry is None:
            raise StaleEvents("worker_id", f"{worker_id!r} has no open registration (register first)")
        if epoch != entry.epoch:
            raise StaleEvents("epoch", f"{epoch} is not the current registration of {worker_id!r} (stale events)")
        if seq <= entry.applied_seq:
            return not entry.exact  # a duplicate: already applied
        if snapshot:
            entry.tiers.clear()
            entry.exact, entry.missing_batches = True, 0
        elif seq != entry.applied_seq + 1:
            entry.exact = False
            entry.missing_batches = seq - entry.applied_seq - 1
            return True
        entry.apply(runs)
        entry.applied_seq, entry.applied_at = seq, self._clock()
        return not entry.exact

    # ---- queries -------------------------------------------------------------------------------
    def leading_blocks(self, worker_id: str, hashes: Sequence[int], tier: str = TIER_POOL) -> int:
        """How many of the chain's first blocks the worker holds in `tier`."""
        entry = self._live(worker_id)
        if entry is None:
            return 0
        blocks = entry.blocks(tier)
        count = 0
        for h in hashes:
            if h not in blocks:
                break
            count += 1
        return count

    def usable_blocks(self, worker_id: str, hashes: Sequence[int]) -> int:
        """How many of the chain's first blocks the worker can use without computing them: those in its pool,
        then those that continue the run in any second tier (it loads them back)."""
        entry = self._live(worker_id)
        if entry is None:
            return 0
        count = 0
        for h in hashes:
            if not any(h in blocks for blocks in entry.tiers.values()):
                break
            count += 1
        return count

    def holders(self, block_hash: int, tier: str = TIER_POOL) -> list[str]:
        """The workers that hold `block_hash` in `tier`."""
        return [e.worker_id for e in self.entries() if block_hash in e.blocks(tier)]

    def entry(self, worker_id: str) -> WorkerBlocks | None:
        return self._live(worker_id)

    def entries(self) -> list[WorkerBlocks]:
        """The entries that count now (leases held)."""
        now = self._clock()
        return [e for e in self._workers.values() if e.lease_until >= now]

    def lag_s(self, entry: WorkerBlocks) -> float | None:
        """Seconds since the entry's last applied batch (None: none yet)."""
        return None if entry.applied_at is None else self._clock() - entry.applied_at

    def distinct_blocks(self, tier: str = TIER_POOL) -> int:
        return len(set().union(*(e.blocks(tier) for e in self.entries())))

    def summary(self, roles: dict[str, str] | None = None) -> dict:
        """A JSON-able view for `pdserve status`: per worker, blocks, exactness and lag."""
        workers = {}
        for e in self.entries():
            lag = self.lag_s(e)
            workers[e.worker_id] = {"role": (roles or {}).get(e.worker_id, ""), "epoch": e.epoch, "exact": e.exact,
                                    "blocks": len(e.blocks()), "lag_s": None if lag is None else round(lag, 3),
                                    "applied_seq": e.applied_seq, "missing_batches": e.missing_batches}
        return {"distinct_blocks": self.distinct_blocks(), "workers": workers}

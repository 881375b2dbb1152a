"""The KV pool's second tier: blocks evicted from the pool keep their KV in host memory or on local disk
(`engine.kv_tier`),
and a later prompt that needs them loads them back instead of recomputing them.

Lifecycle of an entry (a block hash, common/block_hash.py, with every layer's K and V of that block
and a CRC-32C of those bytes):
  save     the BlockManager evicts cached blocks (they are about to be reused): their KV is copied out of
           the pool at once (one call for all of an allocation's blocks), before anything can overwrite
           it, and stored under their hashes;
  lookup   an admission whose prompt continues past the pool's own prefix hits asks how many of the
           next blocks the tier holds, and loads them only while loading is cheaper than computing
           them, judged from rates measured in this process (`LoadRates`);
  load     the entries are read and their checksums verified, then copied into fresh pool blocks (one
           scatter per layer; they then join the prefix cache); a corrupt entry is dropped and reported
           as a miss, so the prompt computes that block and everything after it: a corrupted tier never
           becomes a token;
  drop     least recently used entries go when the byte budget is exceeded.
The pool's blocks and the tier's entries are both named by block hash, so a block is in the pool,
in the tier, or both. `drain_events` tells the router's index what the tier stored and dropped.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import crc32c
import numpy as np
import torch

from common.block_hash import BlockEvents
from common.engine_config import KVTierConfig
from engine.kv_cache import KVCache

log = logging.getLogger(__name__)

CHECKSUM_BYTES = 4
"""An entry is the CRC-32C of its KV (little-endian), then the KV."""


class MemoryStore:
    """Entries in one slab of host memory, a fixed-size slot each (`capacity` slots of `entry_bytes`), reserved
    and faulted in when the tier is made (the budget is resident from the start, as the pool is): a save is one
    copy into a slot. A fresh bytes object per block (until 52a636f) paid its page faults at every save. Measured
    on a Zen 4 (bf16 SmolLM2-135M, 360 KiB a block): 0.40 ms a block before, 0.16-0.26 ms now; the slab of a
    1 GiB budget takes ~0.25 s to fault in. Ordinary pages: advised huge pages (engine.host_memory) were slower
    to fault in there."""

    def __init__(self, capacity: int, entry_bytes: int, pinned: bool = False) -> None:
        """`pinned`: page-locked (a GPU worker's tier: its copies to and from the device are DMA)."""
        self._slab = torch.zeros((capacity, entry_bytes), dtype=torch.uint8, pin_memory=pinned).numpy()
        self._slots: dict[int, int] = {}
        self._free = list(range(capacity - 1, -1, -1))

    def put(self, key: int, checksum: bytes, payload: np.ndarray) -> None:
        slot = self._slots.get(key)
        if slot is None:
            slot = self._slots[key] = self._free.pop()
        self._slab[slot, :CHECKSUM_BYTES] = np.frombuffer(checksum, dtype=np.uint8)
        self._slab[slot, CHECKSUM_BYTES:] = payload

    def get(self, key: int) -> memoryview | None:
        """The entry in place (valid until it is dropped)."""
        slot = self._slots.get(key)
        return None if slot is None else memoryview(self._slab[slot])

    def drop(self, key: int) -> None:
        slot = self._slots.pop(key, None)
        if slot is not None:
            self._free.append(slot)

    def close(self) -> None:
        self._slots.clear()
        self._slab = None


class DiskStore:
    """Entries as one file per block in `directory` (a fresh temporary one when None, removed on close)."""

    def __init__(self, directory: str | None) -> None:
        self._owned = directory is None
        self.directory = Path(tempfile.mkdtemp(prefix="pdserve-kv-tier-") if directory is None else directory)
        self.directory.mkdir(parents=True, exist_ok=True)

    def _path(self, key: int) -> Path:
        return self.directory / f"{key & 0xFFFF_FFFF_FFFF_FFFF:016x}.kv"

    def put(self, key: int, checksum: bytes, payload: np.ndarray) -> None:
        tmp = self._path(key).with_suffix(".tmp")
        with open(tmp, "wb") as f:
            f.write(checksum)
            f.write(payload.data)
        os.replace(tmp, self._path(key))

    def get(self, key: int) -> bytes | None:
        try:
            return self._path(key).read_bytes()
        except FileNotFoundError:
            return None

    def drop(self, key: int) -> None:
        self._path(key).unlink(missing_ok=True)

    def close(self) -> None:
        if self._owned:
            shutil.rmtree(self.directory, ignore_errors=True)


@dataclass
class LoadRates:
    """What bringing a block in (from the tier, or pulled from another worker) and computing it cost here,
    measured (exponential moving averages)."""

    load_s_per_block: float | None = None
    """Seconds to bring one block into the pool (read, verify, copy)."""
    compute_s_per_token: float | None = None
    """Seconds a prompt token costs the engine (its prompt steps' time over their prompt tokens)."""
    smoothing: float = 0.2

    def observe_load(self, seconds: float, blocks: int) -> None:
        self.load_s_per_block = _ewma(self.load_s_per_block, seconds / blocks, self.smoothing)

    def observe_compute(self, seconds: float, tokens: int) -> None:
        if tokens:
            self.compute_s_per_token = _ewma(self.compute_s_per_token, seconds / tokens, self.smoothing)

    def load_pays(self, block_size: int) -> bool:
        """Whether loading a block beats computing its tokens; until both are measured, a load is tried
        (and measured): the tier has no other way to learn its own rate."""
        if self.load_s_per_block is None or self.compute_s_per_token is None:
            return True
        return self.load_s_per_block < self.compute_s_per_token * block_size


@dataclass
class TierStats:
    stored_blocks: int = 0
    loaded_blocks: int = 0
    dropped_blocks: int = 0
    corrupt_blocks: int = 0
    skipped_loads: int = 0
    """Hits not loaded because computing them was measured cheaper."""


@dataclass
class KVTier:
    """One worker's tier: `save` on eviction, `lookup` + `load` on admission (engine thread only)."""

    cache: KVCache
    config: KVTierConfig
    rates: LoadRates = field(default_factory=LoadRates)
    stats: TierStats = field(default_factory=TierStats)

    def __post_init__(self) -> None:
        self.block_bytes = self.cache.layout.bytes_per_block
        self.capacity_blocks = max(1, (self.config.budget_mb << 20) // self.block_bytes)
        self._pinned = self.cache.key_caches[0].device.type == "cuda"
        self.store = (DiskStore(self.config.directory) if self.config.kind == "disk"
                      else MemoryStore(self.capacity_blocks, CHECKSUM_BYTES + self.block_bytes, self._pinned))
        self._lru: OrderedDict[int, None] = OrderedDict()
        self._events: list[tuple[bool, int]] = []
        self._events_lost = False
        self._stage: torch.Tensor | None = None

    @property
    def name(self) -> str:
        """The tier's name in KV events and the router's index."""
        return "disk" if self.config.kind == "disk" else "host"

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._lru

    def __len__(self) -> int:
        return len(self._lru)

    # ---- the BlockManager's side ----------------------------------------------------------------
    def save(self, evicted: list[tuple[int, int]]) -> None:
        """Copy evicted pool blocks' KV out, under their hashes (a block already here is only refreshed), all of an
        allocation's evictions in one call."""
        fresh = []
        for block_id, block_hash in evicted:
            if block_hash in self._lru:
                self._lru.move_to_end(block_hash)
            else:
                fresh.append((block_id, block_hash))
        if not fresh:
            return
        raw = self._read_blocks([b for b, _ in fresh])
        for (_, block_hash), payload in zip(fresh, raw):
            while len(self._lru) >= self.capacity_blocks:
                self._drop(next(iter(self._lru)))
            self.store.put(block_hash, _crc(payload), payload)
            self._lru[block_hash] = None
            self._record(True, block_hash)
            self.stats.stored_blocks += 1

    def loadable(self, hashes: list[int]) -> int:
        """How many of `hashes` (in order) to load: the leading ones held here, while loading pays."""
        count = 0
        for block_hash in hashes:
            if block_hash not in self._lru:
                break
            count += 1
        if count and not self.rates.load_pays(self.cache.layout.block_size):
            self.stats.skipped_loads += count
            return 0
        return count

    def load(self, pairs: list[tuple[int, int]]) -> int:
        """Copy the entries `pairs` (pool block, hash) names into those blocks, in order, up to the first one
        missing or corrupt (dropped); returns how many loaded. One scatter per layer for all of them."""
        started = time.perf_counter()
        payloads = []
        for _, block_hash in pairs:
            stored = self.store.get(block_hash)
            if stored is None or len(stored) != CHECKSUM_BYTES + self.block_bytes or stored[:CHECKSUM_BYTES] != _crc(stored[CHECKSUM_BYTES:]):
                log.warning("KV tier entry %016x is %s: dropped, its block is recomputed", block_hash & (2**64 - 1),
                            "missing" if stored is None else "corrupt")
                self.stats.corrupt_blocks += stored is not None
                self._drop(block_hash)
                break
            payloads.append(memoryview(stored)[CHECKSUM_BYTES:])
            self._lru.move_to_end(block_hash)
        if payloads:
            self._write_blocks([b for b, _ in pairs[: len(payloads)]], payloads)
            self.stats.loaded_blocks += len(payloads)
            self.rates.observe_load(time.perf_counter() - started, len(payloads))
        return len(payloads)

    @property
    def events_lost(self) -> bool:
        return self._events_lost

    @property
    def num_pending_events(self) -> int:
        return len(self._events)

    def drain_events(self, snapshot: bool = False) -> BlockEvents:
        """What the tier stored and dropped since the last drain, or (`snapshot`, or events were lost: nobody
        drained them) every block it holds."""
        events, self._events = self._events, []
        if snapshot or self._events_lost:
            self._events_lost = False
            return BlockEvents([(True, list(self._lru))], snapshot=True, tier=self.name)
        return BlockEvents(BlockEvents.of(events).runs, tier=self.name)

    def _record(self, stored: bool, block_hash: int) -> None:
        if len(self._events) >= 4 * self.capacity_blocks + 4096:  # nobody drains them (no router)
            self._events.clear()
            self._events_lost = True
        if not self._events_lost:
            self._events.append((stored, block_hash))

    def close(self) -> None:
        self.store.close()
        self._lru.clear()

    # ---- internals ------------------------------------------------------------------------------
    def _drop(self, block_hash: int) -> None:
        if block_hash in self._lru:
            del self._lru[block_hash]
            self._record(False, block_hash)
            self.stats.dropped_blocks += 1
        self.store.drop(block_hash)

    def _staging(self, blocks: int) -> torch.Tensor:
        """`[blocks, 2 x layers, block_size, heads, head_dim]` host memory reused across calls (a fresh tensor of
        megabytes per call costs its page faults, more than the copies)."""
        if self._stage is None or self._stage.shape[0] < blocks:
            one = self.cache.key_caches[0][0]
            self._stage = torch.empty(max(blocks, 32), 2 * self.cache.layout.num_layers, *one.shape, dtype=one.dtype,
                                      pin_memory=self._pinned)
        return self._stage[:blocks]

    def _read_blocks(self, block_ids: list[int]) -> np.ndarray:
        """Every layer's K then V of each block, as raw bytes: `[blocks, bytes_per_block]` uint8 (a view of the
        staging memory: valid until the next read or write)."""
        stage = self._staging(len(block_ids))
        caches = [c for layer in range(self.cache.layout.num_layers) for c in (self.cache.key_caches[layer], self.cache.value_caches[layer])]
        on_host = caches[0].device.type == "cpu"
        for row, block in zip(stage, block_ids):
            if on_host:
                torch.stack([c[block] for c in caches], out=row)
            else:
                row.copy_(torch.stack([c[block] for c in caches]))
        return stage.view(torch.uint8).reshape(len(block_ids), -1).numpy()

    def _write_blocks(self, block_ids: list[int], payloads: list[memoryview]) -> None:
        stage = self._staging(len(block_ids))
        raw = stage.view(torch.uint8).reshape(len(block_ids), -1).numpy()
        for row, payload in zip(raw, payloads):
            row[:] = np.frombuffer(payload, dtype=np.uint8)
        device = self.cache.key_caches[0].device
        index = torch.tensor(block_ids, device=device)
        rows = stage.to(device)
        for layer in range(self.cache.layout.num_layers):
            self.cache.key_caches[layer].index_copy_(0, index, rows[:, 2 * layer])
            self.cache.value_caches[layer].index_copy_(0, index, rows[:, 2 * layer + 1])


def _crc(data: bytes | memoryview | np.ndarray) -> bytes:
    return crc32c.crc32c(data).to_bytes(CHECKSUM_BYTES, "little")


def _ewma(current: float | None, sample: float, smoothing: float) -> float:
    return sample if current is None else (1 - smoothing) * current + smoothing * sample

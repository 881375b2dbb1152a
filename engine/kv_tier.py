"""The KV pool's second tier: blocks evicted from the pool keep their KV in host memory or on local disk
(`engine.kv_tier`),
and a later prompt that needs them loads them back instead of recomputing them.

Lifecycle of an entry (a block hash, common/block_hash.py, with every layer's K and V of that block
and a CRC-32C of those bytes):
  save     the BlockManager evicts a cached block (it is about to be reused): its KV is copied out of
           the pool at once, before anything can overwrite it, and stored under its hash;
  lookup   an admission whose prompt continues past the pool's own prefix hits asks how many of the
           next blocks the tier holds, and loads them only while loading is cheaper than computing
           them, judged from rates measured in this process (`LoadRates`);
  load     the entry is read and its checksum verified, then copied into a fresh pool block (which
           then joins the prefix cache); a corrupt entry is dropped and reported as a miss, so the
           prompt computes that block and everything after it: a corrupted tier never becomes a token;
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
import torch

from common.block_hash import BlockEvents
from common.engine_config import KVTierConfig
from engine.kv_cache import KVCache

log = logging.getLogger(__name__)


class MemoryStore:
    """Entries as bytes in this process's (host) memory."""

    def __init__(self) -> None:
        self._entries: dict[int, bytes] = {}

    def put(self, key: int, payload: bytes) -> None:
        self._entries[key] = payload

    def get(self, key: int) -> bytes | None:
        return self._entries.get(key)

    def drop(self, key: int) -> None:
        self._entries.pop(key, None)

    def close(self) -> None:
        self._entries.clear()


class DiskStore:
    """Entries as one file per block in `directory` (a fresh temporary one when None, removed on close)."""

    def __init__(self, directory: str | None) -> None:
        self._owned = directory is None
        self.directory = Path(tempfile.mkdtemp(prefix="pdserve-kv-tier-") if directory is None else directory)
        self.directory.mkdir(parents=True, exist_ok=True)

    def _path(self, key: int) -> Path:
        return self.directory / f"{key & 0xFFFF_FFFF_FFFF_FFFF:016x}.kv"

    def put(self, key: int, payload: bytes) -> None:
        tmp = self._path(key).with_suffix(".tmp")
        tmp.write_bytes(payload)
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
        self.store = DiskStore(self.config.directory) if self.config.kind == "disk" else MemoryStore()
        self.block_bytes = self.cache.layout.bytes_per_block
        self.capacity_blocks = max(1, (self.config.budget_mb << 20) // self.block_bytes)
        self._lru: OrderedDict[int, None] = OrderedDict()
        self._events: list[tuple[bool, int]] = []
        self._events_lost = False

    @property
    def name(self) -> str:
        """The tier's name in KV events and the router's index."""
        return "disk" if self.config.kind == "disk" else "host"

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._lru

    def __len__(self) -> int:
        return len(self._lru)

    # ---- the BlockManager's side ----------------------------------------------------------------
    def save(self, block_id: int, block_hash: int) -> None:
        """Copy an evicted pool block's KV out, under its hash (a block already here is only refreshed)."""
        if block_hash in self._lru:
            self._lru.move_to_end(block_hash)
            return
        payload = self._read_block(block_id)
        self.store.put(block_hash, crc32c.crc32c(payload).to_bytes(4, "little") + payload)
        self._lru[block_hash] = None
        self._record(True, block_hash)
        self.stats.stored_blocks += 1
        while len(self._lru) > self.capacity_blocks:
            self._drop(next(iter(self._lru)))

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

    def load(self, block_id: int, block_hash: int) -> bool:
        """Copy the entry into a pool block; False (and the entry dropped) when it is missing or corrupt."""
        started = time.perf_counter()
        stored = self.store.get(block_hash)
        if stored is None or int.from_bytes(stored[:4], "little") != crc32c.crc32c(stored[4:]) or len(stored) != 4 + self.block_bytes:
            log.warning("KV tier entry %016x is %s: dropped, its block is recomputed", block_hash & (2**64 - 1),
                        "missing" if stored is None else "corrupt")
            self.stats.corrupt_blocks += stored is not None
            self._drop(block_hash)
            return False
        self._write_block(block_id, memoryview(stored)[4:])
        self._lru.move_to_end(block_hash)
        self.stats.loaded_blocks += 1
        self.rates.observe_load(time.perf_counter() - started, 1)
        return True

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

    def _read_block(self, block_id: int) -> bytes:
        """Every layer's K then V of one block, as raw bytes."""
        parts = [c[block_id] for layer in range(self.cache.layout.num_layers) for c in (self.cache.key_caches[layer], self.cache.value_caches[layer])]
        flat = torch.stack(parts).to("cpu", copy=True).contiguous()
        return flat.view(torch.uint8).numpy().tobytes()

    def _write_block(self, block_id: int, payload: memoryview) -> None:
        layout = self.cache.layout
        one = self.cache.key_caches[0][block_id]
        flat = torch.frombuffer(bytearray(payload), dtype=torch.uint8).view(one.dtype).view(2 * layout.num_layers, *one.shape)
        for layer in range(layout.num_layers):
            self.cache.key_caches[layer][block_id].copy_(flat[2 * layer])
            self.cache.value_caches[layer][block_id].copy_(flat[2 * layer + 1])


def _ewma(current: float | None, sample: float, smoothing: float) -> float:
    return sample if current is None else (1 - smoothing) * current + smoothing * sample

"""Who owns which KV block: free list, reference counts and the prefix cache.

Lifecycle of a block: free -> owned by one or more sequences (ref count) -> free again. A block that
became full holds a hash of its tokens chained to its predecessor's hash; when its last owner frees
it, it stays in the free list *with* its contents (evictable, least recently used first) so a later
request with the same prefix can take it back instead of recomputing. With a second tier
(engine.kv_tier) a cached block that is reused for something else is first saved there, and an
admission continues its prefix match into the tier: those blocks are loaded into fresh blocks (when
loading pays) instead of computed. Allocation answers "can't" with False; deciding whom to preempt
is the scheduler's job.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Protocol

from common.block_hash import ROOT, BlockEvents, next_hash
from engine.sequence import Sequence


@dataclass
class PrefixCacheStats:
    queries: int = 0
    query_tokens: int = 0
    hit_tokens: int = 0
    hit_blocks: int = 0


class SecondTier(Protocol):
    """Where evicted cached blocks go (engine.kv_tier.KVTier): it copies KV, the BlockManager never does."""

    def save(self, evicted: list[tuple[int, int]]) -> None: ...

    def loadable(self, hashes: list[int]) -> int: ...

    def load(self, pairs: list[tuple[int, int]]) -> int: ...


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True, tier: SecondTier | None = None):
        self.tier = tier if enable_prefix_caching else None
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._ref_counts = [0] * num_blocks
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._block_hash: dict[int, int] = {}
        self._cached: dict[int, int] = {}  # hash -> block id
        self._seq_hashes: dict[str, list[int]] = {}  # request id -> hashes of its full blocks
        self.prefix_stats = PrefixCacheStats()
        self._events: list[tuple[bool, int]] = []  # (stored?, hash) since the last drain
        self._events_lost = False
        self.max_pending_events = max(4096, 4 * num_blocks)
        """Undrained events past this many are dropped, and the next drain is a snapshot instead."""

    # ---- queries -------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def blocks_for_tokens(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def match_prefix(self, token_ids: list[int], max_tokens: int) -> list[int]:
        """Cached blocks holding a prefix of `token_ids`, covering at most `max_tokens` tokens."""
        if not self.enable_prefix_caching:
            return []
        hits: list[int] = []
        parent = None
        for start in range(0, (max_tokens // self.block_size) * self.block_size, self.block_size):
            h = self._hash(parent, token_ids[start : start + self.block_size])
            block = self._cached.get(h)
            if block is None:
                break
            hits.append(block)
            parent = h
        return hits

    # ---- ownership -----------------------------------------------------------------------------
    def admit(self, seq: Sequence, max_new_tokens: int) -> int | None:
        """Give a new sequence its cached prefix blocks plus fresh blocks for up to `max_new_tokens`
        more tokens. Returns how many tokens it must now compute, or None (nothing taken): no room."""
        cached = self.match_prefix(seq.token_ids, max_tokens=seq.num_tokens - 1) if seq.reuse_cached else []
        in_tier = [] if not seq.reuse_cached else self._tier_hits(seq.token_ids, cached, max_blocks=(seq.num_tokens - 1) // self.block_size)
        cached_tokens = (len(cached) + len(in_tier)) * self.block_size
        num_new = min(seq.num_tokens - cached_tokens, max_new_tokens)
        fresh_needed = self.blocks_for_tokens(cached_tokens + num_new) - len(cached)
        free_after_reuse = self.num_free_blocks - sum(1 for b in cached if self._ref_counts[b] == 0)
        if fresh_needed > free_after_reuse:
            return None
        for block in cached:
            self._take(block)
        fresh = self._pop_free(fresh_needed)
        hashes = [self._block_hash[b] for b in cached] + self._load_from_tier(fresh, in_tier)
        seq.block_ids = cached + fresh
        cached_tokens = len(hashes) * self.block_size
        num_new = min(seq.num_tokens - cached_tokens, max_new_tokens, len(seq.block_ids) * self.block_size - cached_tokens)
        seq.num_cached_tokens = seq.num_computed_tokens = cached_tokens
        self._seq_hashes[seq.request_id] = hashes
        self.prefix_stats.queries += 1
        self.prefix_stats.query_tokens += seq.num_tokens
        self.prefix_stats.hit_blocks += len(hashes)
        self.prefix_stats.hit_tokens += cached_tokens
        return num_new

    def grow(self, seq: Sequence, num_tokens: int) -> bool:
        """Make the sequence's blocks hold `num_tokens` tokens. False (and nothing taken): no room."""
        missing = self.blocks_for_tokens(num_tokens) - len(seq.block_ids)
        if missing <= 0:
            return True
        if missing > self.num_free_blocks:
            return False
        seq.block_ids.extend(self._pop_free(missing))
        self._seq_hashes.setdefault(seq.request_id, [])
        return True

    def pin(self, seq: Sequence) -> bool:
        """Give `seq` references to the cached blocks holding its whole token list (a prefix another worker
        pulls: they must not be evicted while they are read). False (nothing taken): not all cached."""
        blocks = self.match_prefix(seq.token_ids, seq.num_tokens)
        if len(blocks) * self.block_size != seq.num_tokens:
            return False
        for block in blocks:
            self._take(block)
        seq.block_ids = blocks
        self._seq_hashes[seq.request_id] = [self._block_hash[b] for b in blocks]
        return True

    def share(self, parent: Sequence, child: Sequence, num_blocks: int) -> None:
        """A forked sequence takes references to the parent's first `num_blocks` (full, computed) blocks."""
        for block in parent.block_ids[:num_blocks]:
            self._take(block)
        child.block_ids = parent.block_ids[:num_blocks]
        self._seq_hashes[child.request_id] = self._seq_hashes.get(parent.request_id, [])[:num_blocks]

    def commit_computed(self, seq: Sequence) -> None:
        """Publish the sequence's newly completed full blocks in the prefix cache."""
        if not self.enable_prefix_caching:
            return
        hashes = self._seq_hashes.setdefault(seq.request_id, [])
        full = seq.num_computed_tokens // self.block_size
        if len(hashes) >= full:
            return  # most decode steps: no block completed (and token_ids would copy the whole sequence)
        tokens = seq.token_ids
        while len(hashes) < full:
            i = len(hashes)
            h = self._hash(hashes[-1] if hashes else None, tokens[i * self.block_size : (i + 1) * self.block_size])
            hashes.append(h)
            block = seq.block_ids[i]
            if h not in self._cached and block not in self._block_hash:
                self._cached[h] = block
                self._block_hash[block] = h
                self._record(True, h)

    def free(self, seq: Sequence) -> None:
        """Drop the sequence's references; blocks nobody holds return to the free list."""
        # Free the tail first so that, among evictable blocks, a prefix outlives its continuation.
        for block in reversed(seq.block_ids):
            self._ref_counts[block] -= 1
            if self._ref_counts[block] == 0:
                self._free[block] = None
                if block not in self._block_hash:
                    self._free.move_to_end(block, last=False)  # plain blocks are reused first
        seq.block_ids = []
        self._seq_hashes.pop(seq.request_id, None)

    def shrink(self, seq: Sequence, num_tokens: int) -> None:
        """Free the sequence's blocks past the first `num_tokens` tokens (speculative slots it rejected)."""
        keep = self.blocks_for_tokens(num_tokens)
        for block in reversed(seq.block_ids[keep:]):
            self._ref_counts[block] -= 1
            if self._ref_counts[block] == 0:
                self._free[block] = None
                self._free.move_to_end(block, last=False)
        del seq.block_ids[keep:]

    def reset_prefix_cache(self) -> None:
        for h in self._cached:
            self._record(False, h)
        self._cached.clear()
        self._block_hash.clear()

    # ---- KV events (what the router's index learns) ---------------------------------------------
    @property
    def num_pending_events(self) -> int:
        """Events not drained yet (read from any thread: a worker decides whether to send early)."""
        return len(self._events)

    @property
    def events_lost(self) -> bool:
        """Events were dropped (nobody drained them): the next drain is a snapshot."""
        return self._events_lost

    def drain_events(self, snapshot: bool = False) -> BlockEvents:
        """The stores and evictions since the last drain; a snapshot of every cached block instead when
        `snapshot` is asked or events were dropped (nobody drained them)."""
        events, self._events = self._events, []
        if snapshot or self._events_lost:
            self._events_lost = False
            return BlockEvents([(True, list(self._cached))], snapshot=True)
        return BlockEvents.of(events)

    def cached_hashes(self) -> list[int]:
        """Every block hash the prefix cache holds now (tests compare it with the router's index)."""
        return list(self._cached)

    def _record(self, stored: bool, h: int) -> None:
        if self._events_lost:
            return
        if len(self._events) >= self.max_pending_events:
            self._events.clear()
            self._events_lost = True
            return
        self._events.append((stored, h))

    # ---- second tier -----------------------------------------------------------------------------
    def _tier_hits(self, token_ids: list[int], cached: list[int], max_blocks: int) -> list[int]:
        """Hashes of the blocks after the pool's hits that the tier will load (none without a tier)."""
        if self.tier is None or len(cached) >= max_blocks:
            return []
        parent = self._block_hash[cached[-1]] if cached else None
        hashes = []
        for i in range(len(cached), max_blocks):
            parent = self._hash(parent, token_ids[i * self.block_size : (i + 1) * self.block_size])
            hashes.append(parent)
        return hashes[: self.tier.loadable(hashes)]

    def _load_from_tier(self, fresh: list[int], in_tier: list[int]) -> list[int]:
        """Load `in_tier` into the first fresh blocks and publish them; the hashes that loaded (a missing or
        corrupt entry ends the run: that block and the rest are computed)."""
        if not in_tier:
            return []
        loaded = in_tier[: self.tier.load(list(zip(fresh, in_tier)))]
        for block, h in zip(fresh, loaded):
            if h not in self._cached:
                self._cached[h] = block
                self._block_hash[block] = h
                self._record(True, h)
        return loaded

    # ---- internals -----------------------------------------------------------------------------
    def _hash(self, parent: int | None, tokens: list[int]) -> int:
        return next_hash(ROOT if parent is None else parent, tokens)

    def _take(self, block: int) -> None:
        if self._ref_counts[block] == 0:
            del self._free[block]
        self._ref_counts[block] += 1

    def _pop_free(self, count: int) -> list[int]:
        """`count` free blocks, least recently freed first; cached ones among them leave the prefix cache (and
        go to the tier, all in one save, before anything writes into them)."""
        blocks, evicted = [], []
        for _ in range(count):
            block, _ = self._free.popitem(last=False)
            h = self._block_hash.pop(block, None)
            if h is not None and self._cached.get(h) == block:
                del self._cached[h]
                self._record(False, h)
                evicted.append((block, h))
            self._ref_counts[block] = 1
            blocks.append(block)
        if evicted and self.tier is not None:
            self.tier.save(evicted)
        return blocks

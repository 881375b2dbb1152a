"""One worker's KV blocks, as engine/block_manager.py keeps them, counted rather than stored.

Lifecycle of a block: free -> owned by requests (a cached block by its key with a ref count, a
private one only counted) -> when its last owner frees it, a cached block stays in the LRU of
evictable blocks (a later prompt with the same prefix takes it back), a private one is free again.
Allocation evicts the least recently used cached block first; with a second tier the evicted key
goes there (its own LRU) and a later prefix match continues into it (those blocks are loaded, not
computed). Keys are the chained trace hash ids of a prompt's full blocks (sim.workload). `Holding`
is what one request owns on one pool. Allocation answers "can't" with False.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field


@dataclass(slots=True)
class Holding:
    keys: list[int] = field(default_factory=list)
    private: int = 0

    @property
    def blocks(self) -> int:
        return len(self.keys) + self.private


class KVPool:
    def __init__(self, num_blocks: int, tier_blocks: int = 0) -> None:
        self.num_blocks = num_blocks
        self.used = 0
        self.refs: dict[int, int] = {}
        self.lru: OrderedDict[int, None] = OrderedDict()
        self.tier_blocks = tier_blocks
        self.tier: OrderedDict[int, None] = OrderedDict()
        self.stored = 0
        """Blocks copied out into the tier so far (an evicted key the tier already held is only refreshed)."""

    @property
    def available(self) -> int:
        """Blocks an allocation may take now (free ones and evictable cached ones)."""
        return self.num_blocks - self.used

    @property
    def free_fraction(self) -> float:
        return self.available / self.num_blocks

    def match(self, keys: list[int] | tuple[int, ...], limit: int | None = None) -> int:
        """Leading keys cached in the pool (at most `limit`)."""
        n, refs, lru = 0, self.refs, self.lru
        for key in keys[:limit] if limit is not None else keys:
            if key not in refs and key not in lru:
                break
            n += 1
        return n

    def tier_match(self, keys, start: int, limit: int) -> int:
        """Keys after the pool's `start` leading ones that the second tier holds (in a row)."""
        n = 0
        for key in keys[start:limit]:
            if key not in self.tier:
                break
            n += 1
        return n

    def acquire(self, keys, hits: int, new_blocks: int) -> Holding | None:
        """Pin the first `hits` keys (cached here) and take `new_blocks` more; None when they do not fit."""
        pinned_from_lru = sum(1 for key in keys[:hits] if key in self.lru)
        if pinned_from_lru + new_blocks > self.available:
            return None
        held = Holding()
        for key in keys[:hits]:
            if key in self.lru:
                del self.lru[key]
                self.refs[key] = 1
                self.used += 1
            else:
                self.refs[key] += 1
            held.keys.append(key)
        self.used += new_blocks
        held.private = new_blocks
        self._evict()
        return held

    def grow(self, held: Holding, blocks: int) -> bool:
        if blocks > self.available:
            return False
        self.used += blocks
        held.private += blocks
        self._evict()
        return True

    def commit(self, held: Holding, keys) -> None:
        """The request's private blocks now hold `keys` (full prompt blocks computed or received): cache them."""
        for key in keys:
            if held.private <= 0:
                break
            if key in self.refs or key in self.lru:
                continue  # another request cached the same block meanwhile: ours stays private
            self.refs[key] = 1
            held.keys.append(key)
            held.private -= 1
            self.tier.pop(key, None)

    def release(self, held: Holding) -> None:
        for key in held.keys:
            count = self.refs[key] - 1
            if count:
                self.refs[key] = count
            else:
                del self.refs[key]
                self.lru[key] = None
                self.used -= 1
        self.used -= held.private
        held.keys, held.private = [], 0

    def touch(self, keys) -> None:
        for key in keys:
            if key in self.lru:
                self.lru.move_to_end(key)

    def _evict(self) -> None:
        while len(self.lru) > self.num_blocks - self.used:
            key, _ = self.lru.popitem(last=False)
            if self.tier_blocks:
                self.stored += key not in self.tier
                self.tier[key] = None
                self.tier.move_to_end(key)
                if len(self.tier) > self.tier_blocks:
                    self.tier.popitem(last=False)

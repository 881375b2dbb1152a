"""Routing policies: which prefill and which decode worker serve a request.

- round_robin: rotate over healthy workers of the role.
- least_loaded: fewest outstanding requests (router's in-flight count plus the worker's queued and
  running requests from its last `Stats`).
- prefix_aware: prefill goes where the prompt's leading blocks were sent recently (the router keeps
  an approximate, bounded LRU of block hashes per prefill worker), traded against load; decode goes
  to the worker with the most free KV blocks.
Under least_loaded and prefix_aware the decode choice is free-KV aware.
Policies are registered by name in common/plugins.py (which the config validates against) and
built by `make_policy(name, block_size)`; block_size is the engine's (config `engine.block_size`).
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from typing import TYPE_CHECKING

from common.plugins import ROUTING_POLICIES, resolve

if TYPE_CHECKING:  # router.pool builds its policy from here
    from router.pool import Worker


def prefix_block_hashes(token_ids: list[int], block_size: int) -> list[int]:
    """Chained hashes of the prompt's full blocks (the same chaining as the engine's prefix cache)."""
    hashes, parent = [], None
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash((parent, tuple(token_ids[start : start + block_size])))
        hashes.append(parent)
    return hashes


class RoundRobin:
    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._counters: dict[str, itertools.count] = {}

    def choose(self, role: str, candidates: list[Worker], prompt_ids: list[int]) -> Worker:
        counter = self._counters.setdefault(role, itertools.count())
        return candidates[next(counter) % len(candidates)]


class LeastLoaded(RoundRobin):
    def choose(self, role: str, candidates: list[Worker], prompt_ids: list[int]) -> Worker:
        if role == "decode":
            return most_free_kv(candidates)
        return min(candidates, key=lambda w: (w.load, w.routed))


class PrefixAware(LeastLoaded):
    """Approximate prefix-cache-aware prefill routing (no round trip to the workers)."""

    def __init__(self, block_size: int, capacity_blocks: int = 65536, load_weight: float = 4.0) -> None:
        super().__init__(block_size)
        self.capacity_blocks = capacity_blocks
        self.load_weight = load_weight
        self._seen: dict[str, OrderedDict[int, None]] = {}

    def choose(self, role: str, candidates: list[Worker], prompt_ids: list[int]) -> Worker:
        if role == "decode":
            return most_free_kv(candidates)
        hashes = prefix_block_hashes(prompt_ids, self.block_size)
        best = max(candidates, key=lambda w: (self._overlap(w, hashes) - self.load_weight * w.load, -w.routed))
        self._remember(best, hashes)
        return best

    def _overlap(self, worker: Worker, hashes: list[int]) -> int:
        seen = self._seen.get(worker.worker_id)
        if not seen:
            return 0
        matched = 0
        for h in hashes:
            if h not in seen:
                break
            matched += 1
        return matched

    def _remember(self, worker: Worker, hashes: list[int]) -> None:
        seen = self._seen.setdefault(worker.worker_id, OrderedDict())
        for h in hashes:
            seen[h] = None
            seen.move_to_end(h)
        while len(seen) > self.capacity_blocks:
            seen.popitem(last=False)


def most_free_kv(candidates: list[Worker]) -> Worker:
    def free(w: Worker) -> float:
        if w.stats is None or not w.stats.total_kv_blocks:
            return -w.in_flight
        return w.stats.free_kv_blocks / w.stats.total_kv_blocks - 0.01 * w.in_flight

    return max(candidates, key=lambda w: (free(w), -w.routed))


def make_policy(name: str, block_size: int) -> RoundRobin:
    """The policy registered under `name` (common/plugins.py ROUTING_POLICIES)."""
    return resolve(ROUTING_POLICIES, name, "routing policy")(block_size)

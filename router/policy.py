"""Routing policies: which prefill and which decode worker serve a request.

- round_robin: rotate over healthy workers of the role.
- least_loaded: fewest outstanding requests (router's in-flight count plus the worker's queued and
  running requests from its last `Stats`).
- prefix_aware: prefill goes where the prompt's leading blocks were sent recently (the router keeps
  an approximate, bounded LRU of block hashes per prefill worker), traded against load; decode goes
  to the worker with the most free KV blocks.
- kv_aware: both pools by the router's exact KV index (router/kv_index.py, fed by the workers' KV
  events): prefill goes to the worker of the lowest `common.kv_routing.prefill_cost`: where the prompt's KV is
  ready first (the prompt's tokens past the leading blocks it holds, plus the uncomputed prompt tokens
  already sent there, `Worker.pending_prefill_tokens`), with cached tokens computed again off their
  holder charged once more per prefill in flight (under load a conversation stays with its KV); decode goes to the
  worker holding the most leading blocks of the prompt (the conversation's earlier turns: reused,
  not moved) when it has room for the rest, else to the one with the most free KV blocks.
Under least_loaded and prefix_aware the decode choice is free-KV aware.
Policies are registered by name in common/plugins.py (which the config validates against) and
built by `make_policy(name, block_size, index)`; block_size is the engine's (config `engine.block_size`).
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from typing import TYPE_CHECKING

from common.block_hash import chain_hashes
from common.kv_routing import holder_in_balance, prefill_cost
from common.plugins import ROUTING_POLICIES, resolve
from router.kv_index import KVIndex

if TYPE_CHECKING:  # router.pool builds its policy from here
    from router.pool import Worker


class RoundRobin:
    def __init__(self, block_size: int, index: KVIndex | None = None) -> None:
        self.block_size = block_size
        self.index = index or KVIndex()
        self._counters: dict[str, itertools.count] = {}

    def choose(self, role: str, candidates: list[Worker], prompt_ids: list[int]) -> Worker:
        counter = self._counters.setdefault(role, itertools.count())
        return candidates[next(counter) % len(candidates)]

    def prompt_hashes(self, prompt_ids: list[int]) -> list[int]:
        """The chain hashes of the prompt's blocks a worker can hold for it: full blocks, never the one with the
        prompt's last token in it when that ends a block (the engine computes the last token to sample)."""
        return chain_hashes(prompt_ids, self.block_size, max_blocks=(len(prompt_ids) - 1) // self.block_size)

    def usable_tokens(self, worker: Worker, hashes: list[int]) -> int:
        """How many of the prompt's leading tokens (`prompt_hashes`) `worker` holds, in its pool and then its second
        tier, by the index: tokens it needs neither to compute nor to receive."""
        return self.index.usable_blocks(worker.worker_id, hashes) * self.block_size

    def local_prefill_tokens(self, worker: Worker, prompt_ids: list[int]) -> int:
        """The prompt tokens `worker` computes if it prefills the prompt itself (conditional disaggregation):
        the whole prompt for a policy blind to the workers' caches."""
        return len(prompt_ids)


class LeastLoaded(RoundRobin):
    def choose(self, role: str, candidates: list[Worker], prompt_ids: list[int]) -> Worker:
        if role == "decode":
            return most_free_kv(candidates)
        return min(candidates, key=lambda w: (w.load, w.routed))


class PrefixAware(LeastLoaded):
    """Approximate prefix-cache-aware prefill routing (no round trip to the workers)."""

    def __init__(self, block_size: int, index: KVIndex | None = None, capacity_blocks: int = 65536, load_weight: float = 4.0) -> None:
        super().__init__(block_size, index)
        self.capacity_blocks = capacity_blocks
        self.load_weight = load_weight
        self._seen: dict[str, OrderedDict[int, None]] = {}

    def choose(self, role: str, candidates: list[Worker], prompt_ids: list[int]) -> Worker:
        if role == "decode":
            return most_free_kv(candidates)
        hashes = chain_hashes(prompt_ids, self.block_size)
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


class KVAware(RoundRobin):
    """Both pools by the exact KV index: cached overlap (tokens needing no compute and no transfer)
    against the work queued ahead, both in prompt tokens (common/kv_routing.py)."""

    def choose(self, role: str, candidates: list[Worker], prompt_ids: list[int]) -> Worker:
        hashes = self.prompt_hashes(prompt_ids)
        held = {w.worker_id: self.usable_tokens(w, hashes) for w in candidates}
        if role == "decode":
            return self._decode(candidates, held, len(prompt_ids))
        n, most, in_flight = len(prompt_ids), max(held.values()), sum(w.in_flight for w in candidates)
        return min(candidates, key=lambda w: (prefill_cost(n, held[w.worker_id], most, w.pending_prefill_tokens, in_flight), w.routed))

    def local_prefill_tokens(self, worker: Worker, prompt_ids: list[int]) -> int:
        """Only what the worker does not hold, by the index: a conversation's decode worker computes the new turn."""
        return len(prompt_ids) - self.usable_tokens(worker, self.prompt_hashes(prompt_ids))

    def _decode(self, candidates: list[Worker], held: dict[str, int], prompt_tokens: int) -> Worker:
        """The worker holding the most of the prompt, if it has room for the rest and is not much busier than
        the least loaded (`common.kv_routing.holder_in_balance`); else the most free KV."""
        def room(w: Worker) -> bool:
            needed = -(-(prompt_tokens + 1 - held[w.worker_id]) // self.block_size)
            return w.stats is None or not w.stats.total_kv_blocks or w.stats.free_kv_blocks >= needed

        least = min(w.load for w in candidates)
        holders = [w for w in candidates if held[w.worker_id] and room(w) and holder_in_balance(w.load, least)]
        if not holders:
            return most_free_kv(candidates)
        best = max(held[w.worker_id] for w in holders)
        return most_free_kv([w for w in holders if held[w.worker_id] == best])


def most_free_kv(candidates: list[Worker]) -> Worker:
    def free(w: Worker) -> float:
        if w.stats is None or not w.stats.total_kv_blocks:
            return -w.in_flight
        return w.stats.free_kv_blocks / w.stats.total_kv_blocks - 0.01 * w.in_flight

    return max(candidates, key=lambda w: (free(w), -w.routed))


def make_policy(name: str, block_size: int, index: KVIndex | None = None) -> RoundRobin:
    """The policy registered under `name` (common/plugins.py ROUTING_POLICIES), reading `index` (the pool's)."""
    return resolve(ROUTING_POLICIES, name, "routing policy")(block_size, index)

"""The router's choices in the simulator, the same rules as router/policy.py (read, not imported: the
router layer sits above sim/).

- round_robin: rotate over the pool.
- least_loaded: prefill by the fewest outstanding requests (`Worker.load`), decode by the most free KV.
- prefix_aware: prefill where the prompt's leading blocks were sent recently (the router's own bounded
  LRU of keys per worker) minus 4 x load; decode by the most free KV.
- kv_aware: both pools by the exact index (the workers' pools and tiers, read directly: the router's
  index is exact at quiescence): prefill by common/kv_routing.py (the router's own rules); decode to
  the worker holding the most leading blocks if it has room for the rest and is in balance, else the most free KV.
The local-prefill threshold counts `local_prefill_tokens` (router/policy.py's rule).
Ties go to the worker routed to least, then the lowest index.
"""

from __future__ import annotations

from collections import OrderedDict

from common.kv_routing import holder_in_balance, prefill_cost
from sim.workload import SimRequest

POLICIES = ("round_robin", "least_loaded", "prefix_aware", "kv_aware")


class Router:
    def __init__(self, policy: str, block_tokens: int) -> None:
        if policy not in POLICIES:
            raise ValueError(f"policy: must be one of {', '.join(POLICIES)}, got {policy!r}")
        self.policy, self.bt = policy, block_tokens
        self._turn = {"prefill": 0, "decode": 0}
        self._seen: dict[int, OrderedDict[int, None]] = {}

    def choose(self, role: str, workers: list, req: SimRequest):
        if self.policy == "round_robin":
            self._turn[role] += 1
            return workers[(self._turn[role] - 1) % len(workers)]
        if self.policy == "kv_aware":
            return self._kv_aware(role, workers, req)
        if role == "decode":
            return most_free_kv(workers)
        if self.policy == "least_loaded":
            return min(workers, key=lambda w: (w.load, w.routed, w.index))
        return self._prefix_aware(workers, req)

    def _prefix_aware(self, workers: list, req: SimRequest):
        def overlap(w) -> int:
            seen, n = self._seen.get(w.index), 0
            if seen:
                for key in req.keys:
                    if key not in seen:
                        break
                    n += 1
            return n

        best = max(workers, key=lambda w: (overlap(w) - 4.0 * w.load, -w.routed, -w.index))
        seen = self._seen.setdefault(best.index, OrderedDict())
        for key in req.keys:
            seen[key] = None
            seen.move_to_end(key)
        while len(seen) > 65536:
            seen.popitem(last=False)
        return best

    def _kv_aware(self, role: str, workers: list, req: SimRequest):
        n = req.prompt_len
        held = {w.index: w.held_tokens(req) for w in workers}
        if role == "prefill":
            most, in_flight = max(held.values()), sum(w.in_flight for w in workers)
            return min(workers, key=lambda w: (prefill_cost(n, held[w.index], most, w.pending_prefill_tokens, in_flight), w.routed, w.index))

        def room(w) -> bool:
            return w.pool.available >= -(-(n + 1 - held[w.index]) // self.bt)

        least = min(w.load for w in workers)
        holders = [w for w in workers if held[w.index] and room(w) and holder_in_balance(w.load, least)]
        if not holders:
            return most_free_kv(workers)
        best = max(held[w.index] for w in holders)
        return most_free_kv([w for w in holders if held[w.index] == best])

    def local_prefill_tokens(self, worker, req: SimRequest) -> int:
        """What `worker` computes if it prefills `req` itself: under kv_aware what it does not hold, else the prompt."""
        return req.prompt_len - (worker.held_tokens(req) if self.policy == "kv_aware" else 0)


def most_free_kv(workers: list):
    return max(workers, key=lambda w: (w.pool.free_fraction - 0.01 * w.in_flight, -w.routed, -w.index))

"""Per-pool autoscaling policy: signals in, a replica count out. Pure logic; no Ray, no I/O.

The controller (deploy/controller.py) samples every `autoscaler.interval_s`: each worker's `Stats`
(queued prompt tokens, running requests, KV blocks) and the router's TTFT / ITL histograms (diffed
into one window per sample). It builds one `PoolSignals` per pool and asks that pool's
`PoolAutoscaler.decide()`; a `Decision` is carried out by the controller (scale-up: new worker;
scale-down: drain one first), which then calls `record_change()`.

Each signal becomes a *pressure*: its value over its threshold (1.0 = at the threshold).
  prefill: queued_prompt_tokens / (replicas x queued_prompt_tokens_per_worker), ttft / ttft_slo_s
  decode:  kv_usage / kv_usage threshold, running / (replicas x running_requests_per_worker),
           itl / itl_slo_s
Scale up when any pressure exceeds 1 (no sooner than `upscale_cooldown_s` after the last scale-up):
to ceil(replicas x load pressure) for load signals, by one for latency signals. Scale down by one
when every pressure, re-spread over one worker fewer, stays below `downscale_ratio` for
`downscale_cooldown_s`, and the pool's size did not change in that time (hysteresis: a pool does
not flap between two sizes). The pool always stays within [min_replicas, max_replicas].
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from common.config import AutoscalerConfig, PoolConfig

LOAD_SIGNALS = ("queued_prompt_tokens", "running_requests", "kv_usage")
"""Signals that spread over the workers (they shrink per worker when the pool grows)."""


@dataclass
class PoolSignals:
    """One sample of a pool's load. Latencies are None when the window saw no request."""

    replicas: int
    queued_prompt_tokens: int = 0
    running_requests: int = 0
    kv_usage: float = 0.0
    """Used / total KV blocks over the pool's workers (0..1), less the blocks reserved for requests still waiting
    for their prompt's KV (`kv_waiting`): those wait on the prefill pool, a decode worker more would not help them."""
    kv_waiting: float = 0.0
    """KV blocks reserved for requests waiting for remote KV (prefill) / total KV blocks (0..1)."""
    ttft_s: float | None = None
    itl_s: float | None = None

    @classmethod
    def from_stats(cls, replicas: int, stats: Sequence[dict], ttft_s: float | None = None,
                   itl_s: float | None = None) -> PoolSignals:
        total = sum(s.get("total_kv_blocks", 0) for s in stats)
        free = sum(s.get("free_kv_blocks", 0) for s in stats)
        waiting = sum(s.get("waiting_for_kv_blocks", 0) for s in stats)
        return cls(
            replicas=replicas,
            queued_prompt_tokens=sum(s.get("queued_prompt_tokens", 0) for s in stats),
            running_requests=sum(s.get("running_requests", 0) for s in stats),
            kv_usage=max(0, total - free - waiting) / total if total else 0.0,
            kv_waiting=waiting / total if total else 0.0,
            ttft_s=ttft_s,
            itl_s=itl_s,
        )


@dataclass
class Decision:
    replicas: int
    reason: str


@dataclass
class PoolAutoscaler:
    role: str
    policy: AutoscalerConfig
    pool: PoolConfig
    clock: Callable[[], float] = time.monotonic
    last_up: float = -math.inf
    last_change: float = field(default=-math.inf)
    last_busy: float = field(default=-math.inf)
    last_pressure: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # a fresh pool counts as busy: it does not shrink before one downscale cooldown passed
        self.last_busy = self.clock()

    def pressure(self, s: PoolSignals) -> dict[str, float]:
        n = max(1, s.replicas)
        if self.role == "prefill":
            p = self.policy.prefill
            return {
                "queued_prompt_tokens": s.queued_prompt_tokens / (n * p.queued_prompt_tokens_per_worker),
                "ttft": (s.ttft_s or 0.0) / p.ttft_slo_s,
            }
        d = self.policy.decode
        return {
            "kv_usage": s.kv_usage / d.kv_usage,
            "running_requests": s.running_requests / (n * d.running_requests_per_worker),
            "itl": (s.itl_s or 0.0) / d.itl_slo_s,
        }

    def decide(self, s: PoolSignals) -> Decision | None:
        """The pool's new size, or None to keep it."""
        now = self.clock()
        lo, hi = self.pool.min_replicas, self.pool.max_replicas
        if s.replicas < lo:
            return Decision(lo, f"below min_replicas ({s.replicas} < {lo})")
        if s.replicas > hi:
            return Decision(hi, f"above max_replicas ({s.replicas} > {hi})")
        pressure = self.last_pressure = self.pressure(s)
        hot = {k: v for k, v in pressure.items() if v > 1.0}
        if hot:
            self.last_busy = now
            if s.replicas >= hi or now - self.last_up < self.policy.upscale_cooldown_s:
                return None
            load = max((v for k, v in hot.items() if k in LOAD_SIGNALS), default=0.0)
            target = min(hi, max(s.replicas + 1, math.ceil(s.replicas * load)))
            return Decision(target, "; ".join(f"{k} at {v:.2f}x threshold" for k, v in sorted(hot.items())))
        if s.replicas <= lo:
            return None
        spread = s.replicas / (s.replicas - 1) if s.replicas > 1 else math.inf  # to 0 workers: only with no load
        projected = {k: v * spread if k in LOAD_SIGNALS and v > 0 else v for k, v in pressure.items()}
        if any(v >= self.policy.downscale_ratio for v in projected.values()):
            self.last_busy = now
            return None
        quiet_for = now - max(self.last_busy, self.last_change)
        if quiet_for < self.policy.downscale_cooldown_s:
            return None
        return Decision(s.replicas - 1, f"load below {self.policy.downscale_ratio:.2f}x thresholds for {quiet_for:.0f} s")

    def record_change(self, before: int, after: int) -> None:
        """Called once a decision (or a manual scale) has been carried out."""
        now = self.clock()
        self.last_change = now
        if after > before:
            self.last_up = now


def histogram_window(previous: Sequence[tuple[float, float]] | None,
                     current: Sequence[tuple[float, float]]) -> list[tuple[float, float]]:
    """Cumulative bucket counts (upper bound, count) observed between two snapshots."""
    if not previous:
        return list(current)
    before = dict(previous)
    return [(le, count - before.get(le, 0.0)) for le, count in current]


def histogram_quantile(q: float, buckets: Sequence[tuple[float, float]]) -> float | None:
    """Quantile estimate from cumulative buckets (as Prometheus' histogram_quantile: linear within
    the bucket; the largest finite bound when it falls in +Inf). None when there is no sample."""
    buckets = sorted(buckets)
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank = q * buckets[-1][1]
    lower, below = 0.0, 0.0
    for upper, cumulative in buckets:
        if cumulative >= rank:
            if math.isinf(upper):
                return lower
            if cumulative == below:
                return upper
            return lower + (upper - lower) * (rank - below) / (cumulative - below)
        lower, below = upper, cumulative
    return lower

"""`autoscaler.adaptive`: the adaptive controller's policy (deploy/adaptive.py), loaded once with the config.

With `mode: adaptive` one policy, every `autoscaler.interval_s`, picks the router's local-prefill
threshold, the P/D split of the current workers (role switches first) and the pools' sizes; the
per-pool autoscaler's signals and cooldowns (the rest of `autoscaler`) are its inputs.
"""

from __future__ import annotations

from dataclasses import dataclass

from common.validation import ConfigError, is_number, non_negative_int, one_of, positive_int

CONTROLLER_MODES = ("pools", "adaptive")


@dataclass(frozen=True)
class AdaptiveConfig:
    mode: str = "pools"
    """pools: each pool sized on its own signals; adaptive: one policy for threshold, split and sizes."""
    hold_intervals: int = 3
    """A decision acts only once it came out of this many consecutive intervals."""
    action_cooldown_s: float = 60.0
    """After a role switch or a resize, no other switch or resize for this long."""
    threshold_cooldown_s: float = 30.0
    """After a local-prefill threshold change, no other for this long."""
    local_prefill_step: int = 128
    """Tokens the local-prefill threshold moves by in one decision."""
    local_prefill_max: int = 1024
    """The highest local-prefill threshold the controller sets (the lowest is 0: off)."""
    verdict_margin: float = 0.05
    """The verdict moves the threshold only when its margin is beyond this (noise on a loaded machine)."""
    queue_share: float = 0.3
    """A pool is pressed when its waiting stage (prefill_queue, decode_admission) exceeds this share of e2e."""
    idle_busy: float = 0.25
    """A pool whose workers are busy less than this fraction of the time gives a worker to a busy or pressed pool."""
    busy_high: float = 0.8
    """Workers busy this fraction of the time have no time to spare: no more local prefills, no worker given."""
    window_s: float = 60.0
    """The router's critical-path window each snapshot reads (verdict, stage shares, busy fractions)."""

    def validate(self, prefix: str) -> None:
        one_of(f"{prefix}.mode", self.mode, CONTROLLER_MODES)
        positive_int(f"{prefix}.hold_intervals", self.hold_intervals)
        if not is_number(self.window_s) or self.window_s < 1:
            raise ConfigError(f"{prefix}.window_s", f"must be a number >= 1 (seconds), got {self.window_s!r}")
        for name in ("action_cooldown_s", "threshold_cooldown_s"):
            value = getattr(self, name)
            if not is_number(value) or value < 0:
                raise ConfigError(f"{prefix}.{name}", f"must be a number >= 0, got {value!r}")
        positive_int(f"{prefix}.local_prefill_step", self.local_prefill_step)
        non_negative_int(f"{prefix}.local_prefill_max", self.local_prefill_max)
        for name in ("verdict_margin", "queue_share", "idle_busy", "busy_high"):
            value = getattr(self, name)
            if not is_number(value) or not 0 < value < 1:
                raise ConfigError(f"{prefix}.{name}", f"must be a fraction in (0, 1), got {value!r}")

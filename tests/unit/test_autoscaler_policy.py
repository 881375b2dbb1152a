"""The per-pool autoscaling policy on a fake clock: thresholds, SLOs, cooldowns, bounds."""

from __future__ import annotations

import pytest

from common.config import AutoscalerConfig, DecodeScalingConfig, PoolConfig, PrefillScalingConfig
from deploy.autoscaler import PoolAutoscaler, PoolSignals, histogram_quantile, histogram_window

POLICY = AutoscalerConfig(
    enabled=True, interval_s=1, upscale_cooldown_s=10, downscale_cooldown_s=30, downscale_ratio=0.5,
    prefill=PrefillScalingConfig(queued_prompt_tokens_per_worker=1000, ttft_slo_s=1.0),
    decode=DecodeScalingConfig(kv_usage=0.8, running_requests_per_worker=10, itl_slo_s=0.1),
)
POOL = PoolConfig(replicas=1, min_replicas=1, max_replicas=4)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def scaler(role: str, pool: PoolConfig = POOL) -> tuple[PoolAutoscaler, Clock]:
    clock = Clock()
    return PoolAutoscaler(role, POLICY, pool, clock=clock), clock


def test_prefill_scales_up_in_proportion_to_queued_tokens():
    a, _ = scaler("prefill")
    decision = a.decide(PoolSignals(replicas=1, queued_prompt_tokens=2500))
    assert decision.replicas == 3 and "queued_prompt_tokens" in decision.reason


def test_latency_slo_breach_adds_one_worker():
    a, _ = scaler("prefill")
    assert a.decide(PoolSignals(replicas=2, ttft_s=3.0)).replicas == 3
    d, _ = scaler("decode")
    assert d.decide(PoolSignals(replicas=1, itl_s=0.5)).replicas == 2


def test_decode_kv_usage_and_running_requests_scale_up():
    d, _ = scaler("decode")
    assert d.decide(PoolSignals(replicas=1, kv_usage=0.95)).replicas == 2
    d, _ = scaler("decode")
    assert d.decide(PoolSignals(replicas=2, running_requests=25)).replicas == 3


def test_never_beyond_max_or_below_min():
    a, _ = scaler("prefill")
    assert a.decide(PoolSignals(replicas=1, queued_prompt_tokens=10**6)).replicas == POOL.max_replicas
    assert a.decide(PoolSignals(replicas=4, queued_prompt_tokens=10**6)) is None
    assert a.decide(PoolSignals(replicas=0)).replicas == POOL.min_replicas
    assert a.decide(PoolSignals(replicas=6)).replicas == POOL.max_replicas


def test_upscale_cooldown():
    a, clock = scaler("prefill")
    assert a.decide(PoolSignals(replicas=1, queued_prompt_tokens=1500)).replicas == 2
    a.record_change(1, 2)
    clock.now += 5
    assert a.decide(PoolSignals(replicas=2, queued_prompt_tokens=5000)) is None
    clock.now += 6
    assert a.decide(PoolSignals(replicas=2, queued_prompt_tokens=5000)).replicas == 4


def test_downscale_waits_for_a_quiet_cooldown_and_goes_one_at_a_time():
    a, clock = scaler("decode")
    quiet = PoolSignals(replicas=3, running_requests=2, kv_usage=0.1)
    assert a.decide(quiet) is None  # a fresh pool counts as busy for one cooldown
    clock.now += 31
    assert a.decide(quiet).replicas == 2
    a.record_change(3, 2)
    clock.now += 10
    assert a.decide(PoolSignals(replicas=2, running_requests=2, kv_usage=0.15)) is None
    clock.now += 21
    assert a.decide(PoolSignals(replicas=2, running_requests=2, kv_usage=0.15)).replicas == 1
    a.record_change(2, 1)
    clock.now += 100
    assert a.decide(PoolSignals(replicas=1)) is None  # at min_replicas


def test_load_that_would_be_too_high_on_fewer_workers_blocks_downscale():
    a, clock = scaler("decode")
    clock.now += 100
    # 12 running on 2 workers is fine (0.6 of the threshold), but on 1 worker it would be 1.2x
    assert a.decide(PoolSignals(replicas=2, running_requests=12)) is None
    clock.now += 100
    assert a.decide(PoolSignals(replicas=2, running_requests=12)) is None
    # a busy sample resets the quiet period
    clock.now += 10
    assert a.decide(PoolSignals(replicas=2, running_requests=4)) is None
    clock.now += 21
    assert a.decide(PoolSignals(replicas=2, running_requests=4)).replicas == 1


def test_signals_from_worker_stats():
    stats = [
        {"queued_prompt_tokens": 100, "running_requests": 3, "free_kv_blocks": 50, "total_kv_blocks": 100},
        {"queued_prompt_tokens": 20, "running_requests": 1, "free_kv_blocks": 100, "total_kv_blocks": 100},
    ]
    s = PoolSignals.from_stats(2, stats, ttft_s=0.2)
    assert (s.queued_prompt_tokens, s.running_requests, s.kv_usage, s.ttft_s, s.itl_s) == (120, 4, 0.25, 0.2, None)


def test_histogram_quantile_over_a_window():
    before = [(0.1, 10.0), (0.5, 10.0), (1.0, 10.0), (float("inf"), 10.0)]
    after = [(0.1, 10.0), (0.5, 14.0), (1.0, 20.0), (float("inf"), 20.0)]
    window = histogram_window(before, after)
    assert window == [(0.1, 0.0), (0.5, 4.0), (1.0, 10.0), (float("inf"), 10.0)]
    assert histogram_quantile(0.4, window) == pytest.approx(0.5)
    assert histogram_quantile(0.9, window) == pytest.approx(0.5 + 0.5 * (9 - 4) / 6)
    assert histogram_quantile(0.9, histogram_window(after, after)) is None
    assert histogram_quantile(0.99, [(1.0, 1.0), (float("inf"), 10.0)]) == 1.0

"""The adaptive controller's policy on staged snapshots: threshold, P/D split by role switch, pool sizes, hysteresis."""

from __future__ import annotations

import dataclasses

import pytest

from common.config import (
    AutoscalerConfig,
    ConfigError,
    DecodeScalingConfig,
    PoolConfig,
    PoolsConfig,
    PrefillScalingConfig,
    config_from_dict,
)
from common.controller_config import AdaptiveConfig
from deploy.adaptive import AdaptivePolicy, Snapshot
from deploy.autoscaler import PoolSignals
from deploy.commands import format_status
from router.verdict import SplitEstimate

ADAPTIVE = AdaptiveConfig(mode="adaptive", hold_intervals=3, action_cooldown_s=60, threshold_cooldown_s=30,
                          local_prefill_step=128, local_prefill_max=512, verdict_margin=0.05, queue_share=0.3)
CONFIG = AutoscalerConfig(
    enabled=True, interval_s=5, upscale_cooldown_s=10, downscale_cooldown_s=30, downscale_ratio=0.5,
    prefill=PrefillScalingConfig(queued_prompt_tokens_per_worker=1000, ttft_slo_s=1.0),
    decode=DecodeScalingConfig(kv_usage=0.8, running_requests_per_worker=10, itl_slo_s=0.1),
    adaptive=ADAPTIVE,
)
POOLS = PoolsConfig(prefill=PoolConfig(replicas=1, min_replicas=0, max_replicas=3),
                    decode=PoolConfig(replicas=2, min_replicas=1, max_replicas=3))
START = 1000.0
STEP = 5.0


def policy(pools: PoolsConfig = POOLS, config: AutoscalerConfig = CONFIG) -> AdaptivePolicy:
    return AdaptivePolicy(config, pools, now=START)


def prompt_heavy(now: float, p: int = 1, d: int = 2, threshold: int = 0) -> Snapshot:
    """Long prompts queue at the prefill pool; decode is idle; disaggregation pays."""
    return Snapshot(now, PoolSignals(p, queued_prompt_tokens=2500 * p, ttft_s=2.5), PoolSignals(d, running_requests=2, kv_usage=0.1, itl_s=0.03),
                    local_prefill_threshold=threshold, verdict="pays", margin=0.3,
                    shares={"prefill_queue": 0.5, "prefill_compute": 0.3, "decode": 0.1})


def decode_heavy(now: float, p: int = 2, d: int = 1, threshold: int = 256) -> Snapshot:
    """Short prompts, long answers: ITL over its SLO, the prefill pool idle."""
    return Snapshot(now, PoolSignals(p, ttft_s=0.2), PoolSignals(d, running_requests=30, kv_usage=0.6, itl_s=0.3),
                    local_prefill_threshold=threshold, verdict="pays", margin=0.01, shares={"decode": 0.8, "prefill_compute": 0.05})


def idle(now: float, p: int = 1, d: int = 2, threshold: int = 0, verdict: str = "no data", margin: float = 0.0) -> Snapshot:
    return Snapshot(now, PoolSignals(p), PoolSignals(d, running_requests=1, kv_usage=0.05, itl_s=0.02),
                    local_prefill_threshold=threshold, verdict=verdict, margin=margin)


def run(pol: AdaptivePolicy, snapshots) -> list:
    return [pol.decide(s) for s in snapshots]


def test_prompt_heavy_switches_a_decode_worker_to_prefill_rather_than_adding_one():
    pol = policy()
    plans = run(pol, [prompt_heavy(START + i * STEP) for i in range(3)])
    assert [p.switch_to for p in plans] == [None, None, "prefill"]
    assert all(p.resize is None for p in plans), "a role switch is cheaper than a new worker"
    assert "holding (1/3)" in plans[0].reasons[-1] and "prefill pressed" in plans[2].reasons[-1]
    assert plans[2].pressure["prefill"]["queued_prompt_tokens"] == pytest.approx(2.5)
    assert plans[2].pressure["prefill"]["prefill_queue"] == pytest.approx(0.5 / 0.3)


def test_decode_heavy_switches_a_prefill_worker_to_decode_and_lowers_the_threshold():
    pol = policy()
    plans = run(pol, [decode_heavy(START + i * STEP) for i in range(3)])
    assert plans[-1].switch_to == "decode" and plans[-1].resize is None
    assert plans[-1].local_prefill_threshold == 128, "local prefills interfere with a pressed decode pool"
    assert any("decode pressed" in r for r in plans[-1].reasons)


def test_no_room_for_a_switch_adds_a_worker_within_max():
    pools = dataclasses.replace(POOLS, decode=PoolConfig(replicas=1, min_replicas=1, max_replicas=3))
    pol = policy(pools)
    plans = run(pol, [prompt_heavy(START + i * STEP, p=1, d=1) for i in range(3)])
    assert plans[-1].switch_to is None and plans[-1].resize == ("prefill", 3)  # ceil(1 x 2.5 queued pressure)
    at_max = run(policy(pools), [prompt_heavy(START + i * STEP, p=3, d=1) for i in range(4)])
    assert all(p.resize is None and p.switch_to is None for p in at_max), "prefill is at max_replicas, decode at min"


def test_switch_respects_the_target_pools_max():
    pools = dataclasses.replace(POOLS, prefill=PoolConfig(replicas=1, min_replicas=0, max_replicas=1))
    plans = run(policy(pools), [prompt_heavy(START + i * STEP) for i in range(4)])
    assert all(p.switch_to is None and p.resize is None for p in plans)


def test_a_busy_giving_pool_does_not_give_a_worker():
    pol = policy()
    snaps = [dataclasses.replace(prompt_heavy(START + i * STEP), decode=PoolSignals(2, running_requests=15, kv_usage=0.2, itl_s=0.05))
             for i in range(3)]
    plans = run(pol, snaps)
    assert plans[-1].switch_to is None, "15 running over one decode worker is above 10 per worker"
    assert plans[-1].resize == ("prefill", 3)


def test_does_not_pay_raises_the_threshold_step_by_step_up_to_max():
    pol = policy()
    t, now, changes = 0, START, []
    for _ in range(60):
        plan = pol.decide(idle(now, threshold=t, verdict="does not pay", margin=-0.2))
        if plan.local_prefill_threshold is not None:
            t = plan.local_prefill_threshold
            changes.append((now - START, t))
        now += STEP
    assert [c[1] for c in changes] == [128, 256, 384, 512]
    gaps = [b[0] - a[0] for a, b in zip(changes, changes[1:])]
    assert all(g >= ADAPTIVE.threshold_cooldown_s for g in gaps)
    at_max = pol.decide(idle(now, threshold=512, verdict="does not pay", margin=-0.2))
    assert at_max.local_prefill_threshold is None and not any("local prefill" in r for r in at_max.reasons)


def test_pays_lowers_the_threshold_and_noise_leaves_it():
    plans = run(policy(), [idle(START + i * STEP, threshold=256, verdict="pays", margin=0.2) for i in range(3)])
    assert plans[-1].local_prefill_threshold == 128 and "disaggregation pays" in plans[-1].reasons[0]
    noise = run(policy(), [idle(START + i * STEP, threshold=256, verdict="does not pay", margin=-0.02) for i in range(5)])
    assert all(p.local_prefill_threshold is None for p in noise), "a margin within verdict_margin is noise"
    zero = run(policy(), [idle(START + i * STEP, threshold=0, verdict="pays", margin=0.5) for i in range(5)])
    assert all(p.local_prefill_threshold is None for p in zero), "0 is the lowest threshold"


def test_a_pressed_decode_pool_is_never_given_more_local_prefills():
    pol = policy()
    snaps = [dataclasses.replace(decode_heavy(START + i * STEP, threshold=0), verdict="does not pay", margin=-0.3) for i in range(5)]
    assert all(p.local_prefill_threshold is None for p in run(pol, snaps))


def test_alternating_signals_never_act():
    pol = policy()
    snaps = [(prompt_heavy if i % 2 else decode_heavy)(START + i * STEP, p=2, d=2) for i in range(20)]
    plans = run(pol, snaps)
    assert all(p.switch_to is None and p.resize is None for p in plans), "hysteresis: no flapping between roles"


def test_cooldown_after_a_switch():
    pol = policy()
    now, switches = START, []
    p, d = 1, 2
    for _ in range(30):  # prefill stays pressed, decode has room until it is at min
        plan = pol.decide(prompt_heavy(now, p=p, d=d))
        if plan.switch_to == "prefill":
            p, d = p + 1, d - 1
            switches.append(now)
        now += STEP
    assert len(switches) == 1 and d == 1, "decode is at min_replicas after one switch"
    pol2 = policy(dataclasses.replace(POOLS, decode=PoolConfig(replicas=3, min_replicas=1, max_replicas=3)))
    plans = run(pol2, [prompt_heavy(START + i * STEP, p=1, d=3) for i in range(3)]
                + [prompt_heavy(START + i * STEP, p=2, d=2) for i in range(3, 20)])
    acted = [i for i, pl in enumerate(plans) if pl.switch_to]
    assert acted[0] == 2 and acted[1] * STEP - acted[0] * STEP >= ADAPTIVE.action_cooldown_s
    assert any("cooling down" in r for pl in plans[3:acted[1]] for r in pl.reasons)


def test_quiet_pool_shrinks_through_the_folded_autoscaler():
    pools = dataclasses.replace(POOLS, decode=PoolConfig(replicas=3, min_replicas=1, max_replicas=3))
    pol = policy(pools)
    plans = run(pol, [idle(START + i * STEP, p=1, d=3) for i in range(12)])
    resized = [(i, pl.resize) for i, pl in enumerate(plans) if pl.resize]
    assert resized and resized[0][1] in (("prefill", 0), ("decode", 2))
    assert resized[0][0] * STEP >= CONFIG.downscale_cooldown_s, "a fresh pool waits one downscale cooldown"


def test_a_pool_operation_in_flight_holds_the_split_lane():
    pol = policy()
    plans = run(pol, [dataclasses.replace(prompt_heavy(START + i * STEP), pool_busy=True) for i in range(5)])
    assert all(p.switch_to is None and p.resize is None for p in plans)


def test_snapshot_from_the_router_summary():
    summary = {"local_prefill_threshold": 64, "critical_path": {
        "stages": {"prefill_queue": {"share": 0.4, "p50_s": 0.1, "mean_s": 0.1}, "decode": {"share": 0.3, "p50_s": 0, "mean_s": 0}},
        "verdict": {"verdict": "does not pay", "margin": -0.12}}}
    s = Snapshot.from_router(START, PoolSignals(1), PoolSignals(1), summary)
    assert (s.local_prefill_threshold, s.verdict, s.margin) == (64, "does not pay", -0.12)
    assert s.shares == {"prefill_queue": 0.4, "decode": 0.3}
    assert s.inputs()["prefill"]["replicas"] == 1 and "now" not in s.inputs()
    assert s.split is None
    colocated = {"critical_path": {"verdict": {"verdict": "pays", "split": {"itl_s": 0.02, "ttft_s": 3.1, "prefill_busy": 0.5}}}}
    assert Snapshot.from_router(START, PoolSignals(0), PoolSignals(2), colocated).split == SplitEstimate(0.02, 3.1, 0.5)
    empty = Snapshot.from_router(START, PoolSignals(1), PoolSignals(1), {})
    assert (empty.verdict, empty.shares, empty.local_prefill_threshold) == ("no data", {}, 0)


def test_adaptive_config_loads_and_names_bad_fields():
    cfg = config_from_dict({"autoscaler": {"enabled": True, "adaptive": {"mode": "adaptive", "hold_intervals": 2}}})
    assert cfg.autoscaler.adaptive.mode == "adaptive" and cfg.autoscaler.adaptive.hold_intervals == 2
    assert config_from_dict({}).autoscaler.adaptive.mode == "pools"
    for bad, name in (({"mode": "magic"}, "mode"), ({"hold_intervals": 0}, "hold_intervals"),
                      ({"action_cooldown_s": -1}, "action_cooldown_s"), ({"queue_share": 1.5}, "queue_share"),
                      ({"local_prefill_step": 0}, "local_prefill_step"), ({"nope": 1}, "nope")):
        with pytest.raises(ConfigError, match=f"autoscaler.adaptive.{name}"):
            config_from_dict({"autoscaler": {"adaptive": bad}})


def test_plan_shape_and_the_status_line():
    pol = policy()
    plan = run(pol, [prompt_heavy(START + i * STEP, threshold=256) for i in range(3)])[-1]
    snap = prompt_heavy(START, threshold=256)
    assert snap.shape() == "1P/2D, local prefill <= 256 tokens"
    assert plan.shape(snap) == "2P/1D, local prefill <= 256 tokens", "a pressed prefill pool gets no prompts back"
    report = {"router": {}, "pools": {}, "autoscaler": {"enabled": True, "mode": "adaptive", "adaptive": {"reasons": list(plan.reasons)}},
              "events": [{"time": 0.0, "pool": "controller", "from": snap.shape(), "to": plan.shape(snap), "reason": "; ".join(plan.reasons)}]}
    text = format_status(report)
    assert "autoscaler on  mode adaptive" in text and "now: split: prefill pressed" in text
    assert "controller: 1P/2D, local prefill <= 256 tokens -> 2P/1D, local prefill <= 256 tokens (split: prefill pressed" in text


def test_a_growing_pool_holds_on_its_direction_not_on_an_exact_target():
    pools = dataclasses.replace(POOLS, decode=PoolConfig(replicas=1, min_replicas=1, max_replicas=3))
    snaps = [dataclasses.replace(prompt_heavy(START + i * STEP, p=1, d=1), prefill=PoolSignals(1, queued_prompt_tokens=q, ttft_s=2.5))
             for i, q in enumerate((2500, 3500, 2500))]
    assert [p.resize for p in run(policy(pools), snaps)] == [None, None, ("prefill", 3)]


# ---- busy fractions and where a pressure comes from ---------------------------------------------
def saturated_prefill(now: float, threshold: int = 0, decode_busy: float = 0.2) -> Snapshot:
    """1P/1D: long prompts queue at the one prefill worker; the one decode worker (at min_replicas) has time."""
    return Snapshot(now, PoolSignals(1, queued_prompt_tokens=3000, ttft_s=2.5), PoolSignals(1, running_requests=2, kv_usage=0.1, itl_s=0.03),
                    local_prefill_threshold=threshold, verdict="does not pay", margin=-0.01, shares={"prefill_queue": 0.6},
                    busy={"prefill": 1.0, "decode": decode_busy})


def test_a_pressed_prefill_pool_with_no_worker_to_spare_sends_prompts_to_decode_workers_with_time():
    pol = policy()
    plans = run(pol, [saturated_prefill(START + i * STEP) for i in range(3)])
    assert [p.local_prefill_threshold for p in plans] == [None, None, 128]
    assert "workers 100% busy), decode within its SLO and KV (at most 0.30x) but no worker to spare" in plans[-1].reasons[0]
    assert all(p.switch_to is None for p in plans), "decode is at min_replicas: it cannot give its worker"
    near_slo = [dataclasses.replace(saturated_prefill(START + i * STEP), decode=PoolSignals(1, running_requests=2, kv_usage=0.1, itl_s=0.09))
                for i in range(4)]
    assert all(p.local_prefill_threshold is None for p in run(policy(), near_slo)), "a decode pool near its ITL SLO takes no prompts"
    pays = [dataclasses.replace(saturated_prefill(START + i * STEP), verdict="pays", margin=0.1, busy={"prefill": 0.6, "decode": 0.2})
            for i in range(4)]
    assert all(p.local_prefill_threshold is None for p in run(policy(), pays)), "the split pays: local prefills would stretch decode"
    saturated = [dataclasses.replace(s, busy={"prefill": 0.99, "decode": 0.2}) for s in pays]
    assert run(policy(), saturated)[2].local_prefill_threshold == 128, "a saturated prefill pool's queue only grows: capacity first"


def test_an_idle_prefill_pool_gives_its_worker_to_a_busy_decode_pool():
    def snap(now: float, itl_s: float) -> Snapshot:  # every prompt prefills locally now: the prefill worker idles
        return Snapshot(now, PoolSignals(1), PoolSignals(1, running_requests=4, kv_usage=0.2, itl_s=itl_s), local_prefill_threshold=512,
                        verdict="no data", busy={"prefill": 0.02, "decode": 0.99}, local_share=1.0)

    plans = run(policy(), [snap(START + i * STEP, 0.15) for i in range(3)])
    assert [p.switch_to for p in plans] == [None, None, "decode"]
    assert "prefill workers idle (2% busy), decode pressed (itl 1.50x)" in plans[-1].reasons[-1]
    assert all(p.switch_to is None for p in run(policy(), [snap(START + i * STEP, 0.05) for i in range(4)])), \
        "a decode engine 99% busy within its ITL SLO needs no worker"


def test_a_ttft_breach_of_local_prefills_is_not_the_prefill_pools():
    s = dataclasses.replace(saturated_prefill(START), prefill=PoolSignals(1, ttft_s=2.5), local_share=0.75)
    pressure = policy().pressure("prefill", s)
    assert pressure["ttft"] == pytest.approx(2.5 * 0.25) and pressure["prefill_queue"] == pytest.approx(0.6 / 0.3 * 0.25)
    assert policy().pressure("prefill", dataclasses.replace(s, local_share=0.0))["ttft"] == pytest.approx(2.5)


def test_a_pool_whose_workers_lack_time_does_not_give_one():
    snaps = [dataclasses.replace(prompt_heavy(START + i * STEP, p=1, d=2), busy={"prefill": 1.0, "decode": 0.5},
                                 decode=PoolSignals(2, running_requests=2, kv_usage=0.1, itl_s=0.06)) for i in range(3)]
    plans = run(policy(), snaps)
    assert plans[-1].switch_to is None, "two decode workers at 0.6x their ITL SLO would leave one at 1.2x"
    assert plans[-1].resize == ("prefill", 3)


def test_snapshot_reads_busy_fractions_and_local_share():
    summary = {"critical_path": {"requests": 8, "local_prefill": 2, "verdict": {"verdict": "no data"},
                                 "busy": {"prefill": 0.4, "decode": 1.5, "prefill_workers": 1, "decode_workers": 2}}}
    s = Snapshot.from_router(START, PoolSignals(1), PoolSignals(2), summary)
    assert s.busy == {"prefill": pytest.approx(0.4), "decode": pytest.approx(0.75)} and s.local_share == pytest.approx(0.25)
    none = Snapshot.from_router(START, PoolSignals(0), PoolSignals(2), {"critical_path": {"busy": {"prefill": 0, "prefill_workers": 0}}})
    assert none.busy == {} and none.local_share == 0.0


def test_a_pays_verdict_sends_no_prompts_back_to_a_prefill_pool_without_time():
    def snap(now: float, prefill_busy: float) -> Snapshot:
        return Snapshot(now, PoolSignals(1, ttft_s=0.5), PoolSignals(1, running_requests=2, kv_usage=0.1, itl_s=0.03),
                        local_prefill_threshold=512, verdict="pays", margin=0.12, busy={"prefill": prefill_busy, "decode": 0.6})

    assert run(policy(), [snap(START + i * STEP, 0.95) for i in range(4)])[-1].local_prefill_threshold is None
    assert [p.local_prefill_threshold for p in run(policy(), [snap(START + i * STEP, 0.4) for i in range(3)])] == [None, None, 384]


# ---- decode headroom by latency, KV waiting on prefill, free cores, converging to colocated --------
def test_a_busy_decode_engine_within_its_slo_takes_prompts_from_a_saturated_prefill_pool():
    """A decode engine steps whenever it has a stream: 89% busy says nothing; its ITL at 0.3x its SLO says it has room."""
    plans = run(policy(), [saturated_prefill(START + i * STEP, decode_busy=0.89) for i in range(3)])
    assert [p.local_prefill_threshold for p in plans] == [None, None, 128]


def test_kv_reserved_for_requests_waiting_on_prefill_is_prefill_pressure_not_decode():
    stats = [{"total_kv_blocks": 100, "free_kv_blocks": 10, "waiting_for_kv_blocks": 70}]
    decode = PoolSignals.from_stats(1, stats, itl_s=0.03)
    assert decode.kv_usage == pytest.approx(0.2) and decode.kv_waiting == pytest.approx(0.7)
    s = Snapshot(START, PoolSignals(1, queued_prompt_tokens=500, ttft_s=0.5), decode, busy={"prefill": 0.7, "decode": 0.9})
    pol = policy(PoolsConfig(prefill=PoolConfig(replicas=1, min_replicas=1, max_replicas=2),
                             decode=PoolConfig(replicas=1, min_replicas=1, max_replicas=2)))
    assert pol.pressure("decode", s)["kv_usage"] == pytest.approx(0.25)
    assert pol.pressure("prefill", s)["decode_kv_waiting"] == pytest.approx(0.7 / 0.8)
    plans = run(pol, [dataclasses.replace(s, now=START + i * STEP) for i in range(4)])
    assert all(p.resize != ("decode", 2) for p in plans), "a decode worker more would not prefill the waiting prompts"
    full = dataclasses.replace(s, decode=PoolSignals.from_stats(1, [{**stats[0], "free_kv_blocks": 0, "waiting_for_kv_blocks": 90}]))
    assert {"decode_kv_waiting"} <= set(k for k, v in pol.pressure("prefill", full).items() if v > 1.0)


def test_no_worker_is_added_onto_cores_that_are_all_held():
    pools = PoolsConfig(prefill=PoolConfig(replicas=1, min_replicas=1, max_replicas=1), decode=PoolConfig(replicas=1, min_replicas=1, max_replicas=2))
    def hot(now: float, free_cpus) -> Snapshot:
        return Snapshot(now, PoolSignals(1), PoolSignals(1, running_requests=30, kv_usage=0.3, itl_s=0.3), free_cpus=free_cpus)
    assert run(policy(pools), [hot(START + i * STEP, 1.0) for i in range(3)])[-1].resize == ("decode", 2)
    held = run(policy(pools), [hot(START + i * STEP, -0.25) for i in range(4)])
    assert all(p.resize is None for p in held), "every core is held: a third worker would slow the other two"
    assert all(p.resize is None for p in run(policy(pools), [hot(START + i * STEP, 0.5) for i in range(4)])), "half a core is no worker's"


def test_does_not_pay_at_the_max_threshold_switches_the_prefill_worker_to_decode():
    pools = PoolsConfig(prefill=PoolConfig(replicas=1, min_replicas=0, max_replicas=1), decode=PoolConfig(replicas=1, min_replicas=1, max_replicas=2))
    def snap(now: float, threshold: int) -> Snapshot:
        return Snapshot(now, PoolSignals(1, ttft_s=0.3), PoolSignals(1, running_requests=3, kv_usage=0.2, itl_s=0.03),
                        local_prefill_threshold=threshold, verdict="does not pay", margin=-0.3, busy={"prefill": 0.5, "decode": 0.9},
                        local_share=0.6, free_cpus=-0.25)
    plans = run(policy(pools), [snap(START + i * STEP, 512) for i in range(3)])
    assert [p.switch_to for p in plans] == [None, None, "decode"] and "(colocated)" in plans[-1].reasons[-1]
    below = run(policy(pools), [snap(START + i * STEP, 384) for i in range(4)])
    assert all(p.switch_to is None for p in below), "below the max the threshold rises first"
    assert [p.local_prefill_threshold for p in below][:3] == [None, None, 512]
    kept = PoolsConfig(prefill=PoolConfig(replicas=1, min_replicas=1, max_replicas=1), decode=pools.decode)
    assert all(p.switch_to is None for p in run(policy(kept), [snap(START + i * STEP, 512) for i in range(4)])), "min_replicas holds"


def test_with_no_prefill_worker_a_ttft_breach_brings_one_back_from_a_decode_worker_to_spare():
    pools = PoolsConfig(prefill=PoolConfig(replicas=0, min_replicas=0, max_replicas=1), decode=PoolConfig(replicas=2, min_replicas=1, max_replicas=2))
    def snap(now: float, itl_s: float) -> Snapshot:
        return Snapshot(now, PoolSignals(0, ttft_s=2.5), PoolSignals(2, running_requests=4, kv_usage=0.2, itl_s=itl_s),
                        local_prefill_threshold=1024, verdict="no data", busy={"decode": 0.6}, local_share=1.0, free_cpus=-0.25)
    assert policy(pools).pressure("prefill", snap(START, 0.03))["ttft"] == pytest.approx(2.5), "every TTFT is a local prefill's"
    plans = run(policy(pools), [snap(START + i * STEP, 0.03) for i in range(3)])
    assert [p.switch_to for p in plans] == [None, None, "prefill"] and all(p.resize is None for p in plans)
    assert all(p.local_prefill_threshold is None for p in plans), "no prefill worker: the threshold is not the lever"
    assert all(p.switch_to is None for p in run(policy(pools), [snap(START + i * STEP, 0.06) for i in range(4)])), \
        "one decode worker would break the ITL SLO (0.6x over two, 1.2x over one)"
    saturated = [dataclasses.replace(snap(START + i * STEP, 0.03), busy={"decode": 0.95}) for i in range(4)]
    assert all(p.switch_to is None for p in run(policy(pools), saturated)), \
        "colocated workers saturated on held cores: a split only moves the same cores' time behind one more hop"
    assert run(policy(pools), [dataclasses.replace(s, free_cpus=1.0) for s in saturated])[2].switch_to == "prefill", "a free core changes that"


def test_a_saturated_only_prefill_worker_with_no_free_core_goes_colocated():
    """1P/1D on two held cores, long prompts: the prefill worker's queue grows while the decode worker idles."""
    pools = PoolsConfig(prefill=PoolConfig(replicas=1, min_replicas=0, max_replicas=1), decode=PoolConfig(replicas=1, min_replicas=1, max_replicas=2))
    def snap(now: float, **changes) -> Snapshot:
        s = Snapshot(now, PoolSignals(1, queued_prompt_tokens=5000), PoolSignals(1, kv_usage=0.02, kv_waiting=0.9),
                     verdict="no data", busy={"prefill": 0.99, "decode": 0.2}, free_cpus=-0.25)
        return dataclasses.replace(s, **changes)
    plans = run(policy(pools), [snap(START + i * STEP) for i in range(3)])
    assert [p.switch_to for p in plans] == [None, None, "decode"]
    assert "prefill saturated (decode_kv_waiting 1.12x, queued_prompt_tokens 5.00x, workers 99% busy)" in plans[-1].reasons[-1]
    held_back = {
        "a free core takes a second prefill worker instead": dict(free_cpus=1.0),
        "unknown free cores do not hold anything back": dict(free_cpus=None),
        "workers with time to spare are not saturated": dict(busy={"prefill": 0.5, "decode": 0.2}),
        "two prefill workers: the threshold, not a switch, sends prompts to decode": dict(prefill=PoolSignals(2, queued_prompt_tokens=10000)),
    }
    for why, changes in held_back.items():
        assert all(p.switch_to != "decode" for p in run(policy(pools), [snap(START + i * STEP, **changes) for i in range(4)])), why
    pays = run(policy(pools), [snap(START + i * STEP, verdict="pays", margin=0.3) for i in range(3)])
    assert pays[-1].switch_to == "decode", "a queue that only grows costs more than the interference the verdict weighs"
    kept = PoolsConfig(prefill=PoolConfig(replicas=1, min_replicas=1, max_replicas=1), decode=pools.decode)
    assert all(p.switch_to is None for p in run(policy(kept), [snap(START + i * STEP) for i in range(4)])), "min_replicas holds"


def test_a_decode_pool_that_prefills_every_prompt_shrinks_only_if_the_workers_left_keep_time():
    """Colocated (no prefill worker): the decode workers' busy fraction is their prompts' load too, which the
    autoscaler's per-pool signals (running, KV, ITL) do not see; the worker that leaves takes none of it along."""
    pools = PoolsConfig(prefill=PoolConfig(replicas=0, min_replicas=0, max_replicas=1), decode=PoolConfig(replicas=2, min_replicas=1, max_replicas=2))
    def snap(now: float, busy: float) -> Snapshot:
        return Snapshot(now, PoolSignals(0), PoolSignals(2, running_requests=1, kv_usage=0.05, itl_s=0.02), local_prefill_threshold=0,
                        busy={"decode": busy}, local_share=1.0, free_cpus=-0.25)
    busy = run(policy(pools), [snap(START + i * STEP, 0.6) for i in range(12)])
    assert all(p.resize is None for p in busy), "two workers 60 % busy would leave one at 120 %"
    quiet = run(policy(pools), [snap(START + i * STEP, 0.2) for i in range(12)])
    assert ("decode", 1) in [p.resize for p in quiet]


def test_colocated_decode_stretched_by_local_prompts_splits_when_the_split_keeps_the_slos():
    """Long prompts among long answers, no prefill worker: every stream waits for the local prompts' chunks (ITL over
    its SLO); the router's estimate of the split (from the decode workers' prompt steps) keeps ITL and TTFT."""
    pools = PoolsConfig(prefill=PoolConfig(replicas=0, min_replicas=0, max_replicas=1), decode=PoolConfig(replicas=2, min_replicas=1, max_replicas=2))
    split = SplitEstimate(itl_s=0.06, ttft_s=0.5, prefill_busy=0.55)
    def snap(now: float, **changes) -> Snapshot:
        s = Snapshot(now, PoolSignals(0, ttft_s=0.5), PoolSignals(2, running_requests=6, kv_usage=0.3, itl_s=0.15), verdict="does not pay",
                     margin=-0.1, busy={"decode": 0.9}, local_share=1.0, free_cpus=-0.25, split=split)
        return dataclasses.replace(s, **changes)
    plans = run(policy(pools), [snap(START + i * STEP) for i in range(3)])
    assert [p.switch_to for p in plans] == [None, None, "prefill"], "SLOs, not the verdict's mean latency, decide"
    assert all(p.local_prefill_threshold is None for p in plans), "no prefill worker: the threshold moves nothing"
    assert ("decode pressed (itl 1.50x) by local prompts; a split keeps the SLOs (estimated ITL 0.60x, TTFT 0.50x, prefill worker "
            "55% busy)") in plans[-1].reasons[-1]
    held_back = {
        "within the ITL SLO the split is not needed": dict(decode=PoolSignals(2, running_requests=6, kv_usage=0.3, itl_s=0.08)),
        "no estimate (the prompts would saturate one worker)": dict(split=None),
        "the split's ITL too near the SLO": dict(split=dataclasses.replace(split, itl_s=0.085)),
        "the split's TTFT too near the SLO": dict(split=dataclasses.replace(split, ttft_s=0.9)),
        "the prefill worker would have no time to spare": dict(split=dataclasses.replace(split, prefill_busy=0.85)),
        "the streams' KV would not fit one decode worker": dict(decode=PoolSignals(2, running_requests=6, kv_usage=0.5, itl_s=0.15)),
        "a prefill worker is already there: the threshold is the lever": dict(prefill=PoolSignals(1, ttft_s=0.5)),
    }
    for why, changes in held_back.items():
        assert all(p.switch_to != "prefill" for p in run(policy(pools), [snap(START + i * STEP, **changes) for i in range(4)])), why
    one = PoolsConfig(prefill=pools.prefill, decode=PoolConfig(replicas=2, min_replicas=2, max_replicas=2))
    assert all(p.switch_to is None for p in run(policy(one), [snap(START + i * STEP) for i in range(4)])), "decode min_replicas holds"


def test_after_an_interference_split_the_pair_of_inverse_rules_does_not_flap():
    """1P/1D after the interference split, every prompt through the prefill worker. Decode a little over its ITL SLO
    with the prefill worker idle is no reason to go back: colocated, the prompts' chunks would stretch the same ITL.
    A prefill worker at 83 % is busy, not saturated: the way back needs 0.95 (`SATURATED`), above the split's 0.8."""
    pools = PoolsConfig(prefill=PoolConfig(replicas=1, min_replicas=0, max_replicas=1), decode=PoolConfig(replicas=1, min_replicas=1, max_replicas=2))
    def snap(now: float, **changes) -> Snapshot:
        s = Snapshot(now, PoolSignals(1, ttft_s=0.3), PoolSignals(1, running_requests=5, kv_usage=0.2, itl_s=0.109), verdict="pays",
                     margin=0.2, busy={"prefill": 0.24, "decode": 0.97}, local_share=0.0, free_cpus=-0.25)
        return dataclasses.replace(s, **changes)
    assert all(p.switch_to is None for p in run(policy(pools), [snap(START + i * STEP) for i in range(4)]))
    local = run(policy(pools), [snap(START + i * STEP, local_share=1.0) for i in range(3)])
    assert local[-1].switch_to == "decode", "prompts already local: a second decode worker halves their stretch"
    kv = run(policy(pools), [snap(START + i * STEP, decode=PoolSignals(1, running_requests=5, kv_usage=0.9, itl_s=0.109)) for i in range(3)])
    assert kv[-1].switch_to == "decode", "KV pressure is decode load that a second worker takes"
    busy = [snap(START + i * STEP, prefill=PoolSignals(1, queued_prompt_tokens=1500, ttft_s=3.0), busy={"prefill": 0.83, "decode": 0.6})
            for i in range(4)]
    assert all(p.switch_to is None for p in run(policy(pools), busy))

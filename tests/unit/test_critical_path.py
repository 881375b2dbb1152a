"""The critical-path window and the "does disaggregation pay" verdict, fed with figures measured on real
runs (tests/integration/test_critical_path.py's two staged workloads on this machine)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from deploy.commands import format_critical_path
from proto.pdserve.v1 import pdserve_pb2 as pb
from router.critical_path import STAGES, CriticalPathWindow, RequestPath, close_path, in_flight
from router.verdict import PoolBusy, WorkerSteps, judge, judge_colocated


def path(finished_at: float, e2e: float, **stages: float) -> RequestPath:
    full = {s: stages.get(s, 0.0) for s in STAGES}
    return RequestPath(finished_at, full, e2e, e2e - full["decode"], 2, False)


# means per request of the two staged runs (ms): short prompts one at a time; long prompts against decodes
SHORT = dict(router_queue=0.2, decode_admission=0.4, prefill_queue=1.5, prefill_compute=268.7, kv_transfer=7.6,
             first_token=0.4, decode=87.6, other=5.5)
LONG = dict(router_queue=0.1, decode_admission=48.7, prefill_queue=381.2, prefill_compute=1876.3, kv_transfer=11.5,
            first_token=0.4, decode=2625.4, other=307.4)


def sequential(stages_ms: dict, n: int, gap_s: float = 0.02) -> list[RequestPath]:
    e2e = sum(stages_ms.values()) / 1e3
    return [path((i + 1) * (e2e + gap_s), e2e, **{k: v / 1e3 for k, v in stages_ms.items()}) for i in range(n)]


def test_short_prompts_one_at_a_time_do_not_pay():
    paths = sequential(SHORT, 12)
    verdict = judge(paths, PoolBusy(prefill=0.72, decode=0.24, prefill_workers=1, decode_workers=1), in_flight(paths))
    assert in_flight(paths) < 1
    assert verdict.verdict == "does not pay" and verdict.deciding_stage == "kv_transfer"
    assert verdict.added_s == {"decode": 0.0, "prefill_compute": 0.0}  # nothing in flight to interfere with
    assert verdict.colocated_e2e_s == pytest.approx(verdict.disaggregated_e2e_s - (7.6 + 0.4 + 0.4 + 5.5 / 2) / 1e3)
    assert verdict.margin < 0 and "deciding stage: kv_transfer" in verdict.reason


def test_long_prompts_against_decodes_pay():
    e2e = sum(LONG.values()) / 1e3
    paths = [path(t, e2e, **{k: v / 1e3 for k, v in LONG.items()}) for t in (e2e, e2e + 1, e2e + 2)]  # ~3 in flight
    verdict = judge(paths, PoolBusy(prefill=0.86, decode=0.92, prefill_workers=1, decode_workers=1), 2.9)
    assert verdict.verdict == "pays"  # 43 % + 46 % of each colocated worker: interference dominates
    assert verdict.deciding_stage == "decode" and verdict.added_s["decode"] > sum(verdict.saved_s.values())


def test_a_saturated_colocated_pool_makes_disaggregation_pay_and_no_prefill_no_verdict():
    paths = sequential(SHORT, 3)
    assert judge(paths, PoolBusy(1.0, 0.98, 1, 1), 3.0).verdict == "pays"
    assert judge([], PoolBusy(1.0, 1.0, 1, 1), 1.0).verdict == "no data"
    assert judge(paths, PoolBusy(0.0, 0.5, 0, 1), 1.0).verdict == "no data"


def test_close_path_partitions_e2e_with_the_remainder_in_other():
    t = pb.StageTimings(router_queue_s=0.001, decode_admission_s=0.002, prefill_queue_s=0.01, prefill_compute_s=0.2,
                        kv_transfer_s=0.02, ttft_s=0.25)
    close_path(t, arrived=100.0, prefill_done_at=100.245, now=101.0)
    assert t.e2e_s == pytest.approx(1.0) and t.decode_s == pytest.approx(0.75) and t.first_token_s == pytest.approx(0.005)
    assert t.other_s == pytest.approx(1.0 - 0.001 - 0.002 - 0.01 - 0.2 - 0.02 - 0.005 - 0.75)


def worker(worker_id: str, role: str, stamp: float, step_seconds: float):
    return SimpleNamespace(worker_id=worker_id, role=role, stats=pb.WorkerStats(timestamp_s=stamp, step_seconds=step_seconds))


def test_window_busy_fractions_and_breakdown():
    clock = SimpleNamespace(now=0.0)
    window = CriticalPathWindow(clock=lambda: clock.now)
    for second in range(0, 61, 10):
        clock.now = float(second)
        window.observe_workers([worker("p", "prefill", 1000.0 + second, 0.5 * second), worker("d", "decode", 5.0 + second, 0.25 * second)])
    assert window.busy(30.0) == PoolBusy(prefill=0.5, decode=0.25, prefill_workers=1, decode_workers=1)
    timings = pb.StageTimings(prefill_compute_s=0.1, kv_transfer_s=0.01, ttft_s=0.12)
    close_path(timings, arrived=59.0, prefill_done_at=59.115, now=59.6)
    window.record(timings, completion_tokens=5)
    report = window.breakdown(60.0)
    assert report["requests"] == 1 and report["stages"]["decode"]["mean_s"] == pytest.approx(0.48)
    assert sum(f["share"] for f in report["stages"].values()) == pytest.approx(1.0)
    assert report["itl"]["mean_s"] == pytest.approx(0.12)
    lines = format_critical_path(report)
    assert lines[0].startswith("critical path  last 60 s: 1 request(s)") and "DOES NOT PAY" in lines[-1]
    clock.now = 500.0
    window.observe_workers([])
    assert window.breakdown(60.0)["requests"] == 0 and window.steps == {}


def local(finished_at: float, e2e: float, **stages: float) -> RequestPath:
    full = {s: stages.get(s, 0.0) for s in STAGES}
    return RequestPath(finished_at, full, e2e, e2e - full["decode"], 128, True)


# a colocated run's request (s): a long prompt prefilled locally, then 128 tokens decoded among other workers' prompts
LOCAL_LONG = dict(prefill_queue=0.4, prefill_compute=2.0, decode=6.0)


def test_prompt_work_is_what_the_prompt_steps_took_beyond_a_decode_step():
    w = WorkerSteps(span_s=10.0, steps=110, seconds=6.0, prompt_steps=10, prompt_seconds=4.0)  # decode-only steps: 20 ms
    assert w.prompt_work_s == pytest.approx(4.0 - 10 * 0.02)
    assert WorkerSteps(10.0, 5, 2.0, 5, 2.0).prompt_work_s == pytest.approx(2.0), "no decode-only step: all of it"


def test_colocated_long_prompts_among_long_answers_make_a_split_pay():
    paths = [local(t, sum(LOCAL_LONG.values()), **LOCAL_LONG) for t in (10.0, 11.0, 12.0)]
    # two workers, each 30 % of its time on prompt work and 50 % on decode-only steps
    steps = [WorkerSteps(span_s=10.0, steps=110, seconds=8.0, prompt_steps=10, prompt_seconds=3.5)] * 2
    verdict = judge_colocated(paths, steps, hop_s=0.05)
    share = sum(w.prompt_work_s for w in steps) / 16.0
    assert verdict.verdict == "pays" and verdict.deciding_stage == "decode" and verdict.estimated == "disaggregated"
    assert verdict.prefill_busy == pytest.approx(2 * 3.05 / 10) and verdict.added_s["decode"] == pytest.approx(6.0 * share)
    load = verdict.prefill_busy
    queue = load * 2.0 / (2 * (1 - load))  # one prefill worker at ~60 %, every prompt 2 s: M/D/1 wait
    assert verdict.disaggregated_e2e_s == pytest.approx(8.4 - 6.0 * share - 0.4 + queue + 0.05)
    assert verdict.margin > 0 and verdict.reason.startswith("colocated 8400 ms vs split (estimated)")
    assert verdict.split.itl_s == pytest.approx(2 * 0.045), "the decode-only steps' mean, with both workers' streams on one"
    assert verdict.split.ttft_s == pytest.approx(queue + 2.0 + 0.05) and verdict.split.prefill_busy == verdict.prefill_busy
    assert "(no split measured yet" in judge_colocated(paths, steps, hop_s=None).reason


def test_a_split_whose_prefill_worker_would_saturate_or_that_has_no_worker_to_spare_does_not_pay():
    paths = [local(10.0, 8.4, **LOCAL_LONG)]
    busy = [WorkerSteps(span_s=10.0, steps=60, seconds=9.5, prompt_steps=50, prompt_seconds=9.0)] * 2
    saturated = judge_colocated(paths, busy, hop_s=0.05)
    assert saturated.verdict == "does not pay" and "saturated" in saturated.reason and saturated.prefill_busy >= 0.95
    assert saturated.split is None
    light = [WorkerSteps(span_s=10.0, steps=200, seconds=4.04, prompt_steps=1, prompt_seconds=0.04)] * 2
    unqueued = [local(10.0, 8.0, **{**LOCAL_LONG, "prefill_queue": 0.0})]
    assert judge_colocated(unqueued, light, hop_s=0.05).verdict == "does not pay", "prompts barely stretch decode: the hop costs more"
    assert judge_colocated(paths, light[:1], hop_s=0.05).verdict == "no data"
    assert judge_colocated([], light, hop_s=0.05).verdict == "no data"


def test_with_no_prefill_worker_the_window_estimates_the_split_from_the_decode_workers_prompt_steps():
    clock = SimpleNamespace(now=0.0)
    window = CriticalPathWindow(clock=lambda: clock.now)
    for second in range(0, 31, 10):
        clock.now = float(second)
        stats = [pb.WorkerStats(timestamp_s=100.0 + second, steps=11 * second, step_seconds=0.8 * second, prompt_steps=second,
                                prompt_step_seconds=0.35 * second) for _ in range(2)]
        window.observe_workers([SimpleNamespace(worker_id=f"d{i}", role="decode", stats=st) for i, st in enumerate(stats)])
    for t in (26.0, 28.0, 30.0):
        clock.now = t
        timings = pb.StageTimings(prefill_queue_s=0.4, prefill_compute_s=2.0, ttft_s=2.4, local_prefill=True)
        close_path(timings, arrived=t - 8.4, prefill_done_at=None, now=t)
        window.record(timings, completion_tokens=128)
    assert window.decode_steps(20.0)[0] == WorkerSteps(span_s=20.0, steps=220, seconds=16.0, prompt_steps=20, prompt_seconds=7.0)
    report = window.breakdown(20.0)
    verdict = report["verdict"]
    assert verdict["verdict"] == "pays" and verdict["estimated"] == "disaggregated" and verdict["prefill_busy"] == pytest.approx(0.61)
    assert format_critical_path(report)[-2] == "  split estimate: ITL 90.0 ms, TTFT 3564 ms, one prefill worker 61% busy"
    assert window.hop_s() is None, "no request went through a prefill worker"
    split = pb.StageTimings(prefill_compute_s=0.5, kv_transfer_s=0.03, decode_admission_s=0.01, ttft_s=0.6)
    close_path(split, arrived=29.0, prefill_done_at=29.55, now=30.0)
    window.record(split, completion_tokens=4)
    assert window.hop_s() == pytest.approx(0.03 + 0.01 + 0.05)

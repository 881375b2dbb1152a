"""Scheduler policies on their own (no model, no tensors): request priority (admission order, FCFS
within a priority, preemption victim) and the KV admission policies (max_utilization preempts,
guaranteed_no_evict admits only what can run to its end, also for KV arriving from a prefill worker)."""

from __future__ import annotations

import pytest

from common.engine_config import EngineConfig
from common.errors import InvalidRequestError
from common.sampling import SamplingParams
from common.validation import ConfigError
from engine.block_manager import BlockManager
from engine.scheduler import Scheduler, SchedulerConfig
from engine.sequence import RequestState, Sequence, check_priority


def seq(rid: str, n: int, max_tokens: int = 8, priority: int = 0, **kw) -> Sequence:
    return Sequence(rid, list(range(1, n + 1)), SamplingParams(max_tokens=max_tokens), priority=priority, **kw)


def ids(items) -> list[str]:
    return [getattr(s, "seq", s).request_id for s in items]


def decode_one(plan) -> None:
    """What the engine does after a step: the scheduled tokens are computed, each sampler appends one."""
    for item in plan.scheduled:
        samples = item.samples
        item.seq.num_computed_tokens += item.num_tokens
        if samples:
            item.seq.output_token_ids.append(7)


def test_higher_priority_admitted_first_fcfs_within_priority():
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=8), BlockManager(num_blocks=64, block_size=4))
    for rid, priority in [("low-1", -5), ("mid-1", 0), ("high-1", 7), ("mid-2", 0), ("high-2", 7), ("low-2", -5)]:
        sched.add(seq(rid, 4, priority=priority))
    assert ids(sched.waiting) == ["high-1", "high-2", "mid-1", "mid-2", "low-1", "low-2"]
    assert ids(sched.schedule().scheduled) == ["high-1", "high-2"]  # the budget (8 tokens) takes two prompts
    assert ids(sched.running) == ["high-1", "high-2"]


def test_running_order_follows_priority_and_late_high_priority_runs_first():
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=64), BlockManager(num_blocks=64, block_size=4))
    sched.add(seq("low", 4, priority=-1))
    decode_one(sched.schedule())
    sched.add(seq("high", 4, priority=3))
    plan = sched.schedule()
    assert ids(plan.scheduled) == ["low", "high"]  # running first, then admission
    assert ids(sched.running) == ["high", "low"]  # ... but the running queue is kept in priority order
    decode_one(plan)
    assert ids(sched.schedule().scheduled) == ["high", "low"]


def test_preemption_takes_lowest_priority_then_latest_arrival():
    bm = BlockManager(num_blocks=6, block_size=4)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=64), bm)
    first_low, high, second_low = seq("first-low", 8, priority=-1), seq("high", 8, priority=5), seq("second-low", 8, priority=-1)
    for s in (first_low, high, second_low):
        sched.add(s)
    plan = sched.schedule()
    assert ids(plan.scheduled) == ["high", "first-low", "second-low"] and bm.num_free_blocks == 0
    decode_one(plan)
    plan = sched.schedule()  # every request needs a third block: the lowest priority, latest arrival yields
    # high takes the blocks second-low frees, first-low then grows into the rest
    assert plan.preempted == [second_low] and ids(plan.scheduled) == ["high", "first-low"]
    assert second_low.state is RequestState.WAITING and second_low.num_computed_tokens == 0
    decode_one(plan)
    for _ in range(3):  # up to 12 tokens each: three blocks hold them
        plan = sched.schedule()
        assert not plan.preempted
        decode_one(plan)
    plan = sched.schedule()  # the 13th token needs a fourth block: first-low yields, never high
    assert plan.preempted == [first_low] and ids(plan.scheduled) == ["high"]
    assert ids(sched.waiting) == ["first-low", "second-low"]  # re-queued in arrival order within their priority


def test_preempted_request_requeues_ahead_of_later_arrivals_of_its_priority():
    bm = BlockManager(num_blocks=4, block_size=4)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=64), bm)
    first, second = seq("first", 8), seq("second", 8)
    sched.add(first)
    sched.add(second)
    decode_one(sched.schedule())
    later_high, later_same = seq("later-high", 4, priority=1), seq("later-same", 4)
    sched.add(later_same)
    sched.add(later_high)
    plan = sched.schedule()
    assert plan.preempted == [second]
    assert ids(sched.waiting) == ["later-high", "second", "later-same"]


def test_max_utilization_admits_what_fits_now_and_preempts_later():
    bm = BlockManager(num_blocks=6, block_size=4)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=64), bm)
    a, b = seq("a", 8, max_tokens=8), seq("b", 8, max_tokens=8)  # each may reach 16 tokens = 4 blocks
    sched.add(a)
    sched.add(b)
    plan = sched.schedule()
    assert ids(plan.scheduled) == ["a", "b"]
    preempted = []
    while sched.num_unfinished and len(a.output_token_ids) < 8:
        decode_one(plan)
        plan = sched.schedule()
        preempted += plan.preempted
    assert preempted, "two requests of 4 blocks each on 6 blocks must preempt under max_utilization"


def run_no_evict(num_blocks: int, requests: list[Sequence]) -> tuple[Scheduler, list[list[str]]]:
    """Every request to its max_tokens under guaranteed_no_evict; returns the scheduler and who was admitted each step."""
    bm = BlockManager(num_blocks=num_blocks, block_size=4)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=64, kv_policy="guaranteed_no_evict"), bm)
    for s in requests:
        sched.add(s)
    admitted = []
    while sched.num_unfinished:
        before = set(ids(sched.running))
        plan = sched.schedule()
        assert not plan.preempted, "guaranteed_no_evict preempted a request"
        admitted.append([r for r in ids(sched.running) if r not in before])
        decode_one(plan)
        for s in list(sched.running):
            if len(s.output_token_ids) >= s.params.max_tokens:
                s.state = RequestState.FINISHED_LENGTH
                sched.remove(s)
                bm.free(s)
    assert bm.num_free_blocks == num_blocks
    return sched, admitted


def test_guaranteed_no_evict_admits_only_whole_lives_and_never_preempts():
    # a and b each need 4 blocks over their life (8 prompt + 8 new tokens): 6 blocks hold one at a time
    a, b = seq("a", 8, max_tokens=8), seq("b", 8, max_tokens=8)
    _, admitted = run_no_evict(6, [a, b])
    assert admitted[0] == ["a"], "b must wait: its blocks are promised to a"
    assert ["b"] in admitted[1:]
    # on 8 blocks both fit at once
    _, admitted = run_no_evict(8, [seq("a", 8, max_tokens=8), seq("b", 8, max_tokens=8)])
    assert admitted[0] == ["a", "b"]


def test_guaranteed_no_evict_counts_forks_and_keeps_priority_order():
    group = seq("group", 4, max_tokens=8, forks_pending=1)  # 3 blocks + its fork's 2 + 1
    _, admitted = run_no_evict(8, [group, seq("other", 4, max_tokens=8)])
    assert admitted[0] == ["group"], "the fork's promised blocks leave no room for other"
    _, admitted = run_no_evict(6, [seq("low", 8, max_tokens=8, priority=-3), seq("high", 8, max_tokens=8, priority=3)])
    assert admitted[0] == ["high"] and ["low"] in admitted[1:]


@pytest.mark.parametrize("policy, admitted", [("max_utilization", True), ("guaranteed_no_evict", False)])
def test_remote_kv_reservation_respects_the_policy(policy, admitted):
    bm = BlockManager(num_blocks=6, block_size=4)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=64, kv_policy=policy), bm)
    running = seq("running", 8, max_tokens=8)
    sched.add(running)
    sched.schedule()  # 2 blocks taken, 2 more promised under guaranteed_no_evict
    incoming = seq("incoming", 8, max_tokens=8)  # needs 3 blocks now, 4 over its life
    assert sched.reserve_remote(incoming) is admitted
    if admitted:
        assert incoming.state is RequestState.WAITING_FOR_REMOTE_KV and len(incoming.block_ids) == 3
        sched.remove(incoming)
        bm.free(incoming)
    else:
        assert incoming.block_ids == [] and bm.num_free_blocks == 4
        small = seq("small", 3, max_tokens=1)  # one block over its life: fits beside running's promise
        assert sched.reserve_remote(small) and sched.incoming == [small]
        sched.add_running(small)
        assert sched.incoming == [] and small in sched.running


def test_kv_policy_config_is_validated_and_priority_range_checked():
    assert EngineConfig().kv_policy == "max_utilization"
    assert EngineConfig.from_dict({"kv_policy": "guaranteed_no_evict"}).kv_policy == "guaranteed_no_evict"
    with pytest.raises(ConfigError, match=r"^engine\.kv_policy: must be one of max_utilization, guaranteed_no_evict"):
        EngineConfig.from_dict({"kv_policy": "no_evict"})
    assert check_priority(-1000) == -1000 and check_priority(1000) == 1000
    for bad in (1001, -1001, True, 1.5, "1"):
        with pytest.raises(InvalidRequestError) as err:
            check_priority(bad)
        assert err.value.field == "priority"

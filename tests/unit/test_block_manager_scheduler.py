"""BlockManager and Scheduler on their own: no model, no tensors."""

from __future__ import annotations

from common.sampling import SamplingParams
from engine.block_manager import BlockManager
from engine.scheduler import Scheduler, SchedulerConfig
from engine.sequence import RequestState, Sequence


def seq(rid: str, n: int, max_tokens: int = 8) -> Sequence:
    return Sequence(rid, list(range(1, n + 1)), SamplingParams(max_tokens=max_tokens))


def test_admit_grow_free_roundtrip():
    bm = BlockManager(num_blocks=8, block_size=4)
    s = seq("a", 10)
    assert bm.admit(s, 10) == 10
    assert len(s.block_ids) == 3 and bm.num_free_blocks == 5
    assert bm.grow(s, 13) and len(s.block_ids) == 4
    assert not bm.grow(s, 100) and len(s.block_ids) == 4  # all or nothing
    bm.free(s)
    assert bm.num_free_blocks == 8 and s.block_ids == []


def test_prefix_cache_hit_refcount_and_lru_eviction():
    bm = BlockManager(num_blocks=6, block_size=4)
    a = seq("a", 9)
    bm.admit(a, 9)
    a.num_computed_tokens = 9
    bm.commit_computed(a)
    b = seq("b", 9)
    assert bm.admit(b, 9) == 1  # two full blocks cached, last token recomputed
    assert b.block_ids[:2] == a.block_ids[:2] and b.num_cached_tokens == 8
    bm.free(a)
    bm.free(b)
    assert bm.num_free_blocks == 6
    c = seq("c", 9)
    assert bm.admit(c, 9) == 1 and bm.prefix_stats.hit_blocks == 4  # cached blocks survive freeing
    bm.free(c)
    big = Sequence("big", list(range(100, 124)), SamplingParams())
    assert bm.admit(big, 24) == 24  # takes every block, evicting the cache
    bm.free(big)
    d = seq("d", 9)
    assert bm.admit(d, 9) == 9 and d.num_cached_tokens == 0
    bm.free(d)


def test_prefix_cache_disabled():
    bm = BlockManager(num_blocks=6, block_size=4, enable_prefix_caching=False)
    a = seq("a", 9)
    bm.admit(a, 9)
    a.num_computed_tokens = 9
    bm.commit_computed(a)
    b = seq("b", 9)
    assert bm.admit(b, 9) == 9


def test_scheduler_budget_chunks_and_decode_first():
    bm = BlockManager(num_blocks=64, block_size=4)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=10, max_num_seqs=8), bm)
    long, short = seq("long", 25), seq("short", 3)
    sched.add(long)
    sched.add(short)
    plan = sched.schedule()
    assert [(s.seq.request_id, s.num_tokens) for s in plan.scheduled] == [("long", 10)]
    long.num_computed_tokens += 10
    plan = sched.schedule()
    assert [(s.seq.request_id, s.num_tokens) for s in plan.scheduled] == [("long", 10)]
    long.num_computed_tokens += 10
    plan = sched.schedule()
    assert [(s.seq.request_id, s.num_tokens) for s in plan.scheduled] == [("long", 5), ("short", 3)]
    assert plan.scheduled[0].samples and plan.scheduled[1].samples


def test_scheduler_without_chunking_runs_prompts_whole_and_never_starves_them():
    bm = BlockManager(num_blocks=64, block_size=4)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=10, enable_chunked_prefill=False), bm)
    sched.add(seq("a", 3))
    sched.add(seq("b", 25))
    sched.add(seq("c", 25))
    plan = sched.schedule()
    assert [(s.seq.request_id, s.num_tokens) for s in plan.scheduled] == [("a", 3)]  # b does not fit beside a
    plan.scheduled[0].seq.num_computed_tokens = 3
    plan.scheduled[0].seq.output_token_ids.append(7)
    plan = sched.schedule()
    # a decodes; the oldest waiting prompt runs whole beside it (over budget) instead of starving,
    # the next long prompt waits for another step
    assert [(s.seq.request_id, s.num_tokens) for s in plan.scheduled] == [("a", 1), ("b", 25)]
    assert [s.request_id for s in sched.waiting] == ["c"]


def test_scheduler_preempts_latest_when_blocks_run_out():
    bm = BlockManager(num_blocks=4, block_size=4)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=64), bm)
    first, second = seq("first", 8), seq("second", 8)
    sched.add(first)
    sched.add(second)
    plan = sched.schedule()
    assert len(plan.scheduled) == 2 and bm.num_free_blocks == 0
    for s in (first, second):
        s.num_computed_tokens = 8
        s.output_token_ids.append(1)
    plan = sched.schedule()  # both need a 3rd block: the later one yields
    assert [s.seq.request_id for s in plan.scheduled] == ["first"]
    assert plan.preempted == [second]
    assert second.state is RequestState.WAITING and second.num_computed_tokens == 0
    assert sched.waiting[0] is second

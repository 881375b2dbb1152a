"""The KV admission policies and request priority on the real demo model: under a KV budget that makes
`max_utilization` preempt, `guaranteed_no_evict` never preempts; both stay == HF generate token for
token, with mixed priorities, and free every block at the end."""

from __future__ import annotations

import pytest

from engine import SamplingParams
from tests.conftest import assert_no_leaked_blocks, make_engine, run_to_completion

MAX_NEW = 24


def budget(prompts: list[list[int]]) -> int:
    """Half the blocks the batch needs at its peak, but room for the longest request's whole life."""
    needed = sum(-(-(len(p) + MAX_NEW) // 16) for p in prompts)
    longest = max(-(-(len(p) + MAX_NEW) // 16) for p in prompts)
    return max(longest + 2, needed // 2)


@pytest.mark.parametrize("policy", ["max_utilization", "guaranteed_no_evict"])
def test_kv_policy_under_a_tight_pool_matches_hf(demo_model, demo_prompt_ids, hf_greedy, policy):
    engine = make_engine(demo_model, dtype="float32", num_kv_blocks=budget(demo_prompt_ids), kv_policy=policy)
    for i, ids in enumerate(demo_prompt_ids):  # mixed priorities: every third request high, one low
        engine.add_request(f"r{i}", ids, SamplingParams(max_tokens=MAX_NEW), priority=(5 if i % 3 == 0 else 0) - (i == 4))
    out = run_to_completion(engine)
    for i, ids in enumerate(demo_prompt_ids):
        assert out[f"r{i}"] == hf_greedy(tuple(ids), MAX_NEW), f"r{i} differs from HF"
    preemptions = engine.stats().num_preemptions
    if policy == "max_utilization":
        assert preemptions > 0, "the KV budget did not force max_utilization to preempt"
    else:
        assert preemptions == 0, f"guaranteed_no_evict preempted {preemptions} times"
    assert_no_leaked_blocks(engine)


def test_decode_engine_reservation_waits_under_guaranteed_no_evict(demo_model, demo_prompt_ids, hf_greedy):
    """A decode engine receiving KV: a reservation the promised blocks leave no room for is refused
    (the worker retries later) though the free blocks would hold its prompt (what max_utilization
    asks); it goes through once room frees."""
    first, second = demo_prompt_ids[6], min(demo_prompt_ids, key=len)
    blocks = -(-(len(first) + MAX_NEW) // 16) + 1  # the first request's whole life and one block more
    engine = make_engine(demo_model, dtype="float32", num_kv_blocks=blocks, kv_policy="guaranteed_no_evict")
    engine.add_request("first", first, SamplingParams(max_tokens=MAX_NEW))
    tokens = [t for o in engine.step() for t in o.new_token_ids]
    assert engine.stats().free_blocks >= -(-(len(second) + 1) // 16), "the prompt alone must fit the free blocks"
    assert engine.add_remote_request("second", second, SamplingParams(max_tokens=MAX_NEW)) is None
    tokens += run_to_completion(engine)["first"]
    assert tokens == hf_greedy(tuple(first), MAX_NEW)
    assert engine.add_remote_request("second", second, SamplingParams(max_tokens=MAX_NEW)) is not None
    engine.abort("second")
    run_to_completion(engine)
    assert engine.stats().num_preemptions == 0
    assert_no_leaked_blocks(engine)

"""The cluster simulator against closed-form cases: an M/D/1 queue's mean wait, one request's TTFT as the sum
of its stages, prefix reuse on both sides, preemption under a tiny KV pool, determinism, and the full
Mooncake conversation trace at 256 GPUs. Every test ends with no KV block held anywhere."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from bench.trace.workload import reuse_bound
from common.mooncake import Scale, load_trace, select_window
from sim.cluster import Cluster, ClusterSpec
from sim.profile import linear_profile
from sim.workload import SimRequest, chain_keys, from_trace, synthetic

REPO = Path(__file__).resolve().parents[2]
TRACE = Path("/work/shared/traces/mooncake_conversation_trace.jsonl")
if not TRACE.exists():
    TRACE = REPO.parent / "shared" / "traces" / "mooncake_conversation_trace.jsonl"


def run(spec: ClusterSpec, profile, requests):
    cluster = Cluster(spec, profile)
    result = cluster.run(requests)
    for w in cluster.prefills + cluster.decodes:  # nothing leaked: every block free or only cached
        assert w.pool.used == 0 and not w.running and not w.waiting and not w.admission and w.incoming == 0, w.index
    return result


def test_md1_mean_wait_matches_pollaczek_khinchine():
    """One prefill worker serving equal prompts one per step is an M/D/1 queue: Wq = rho D / (2 (1 - rho))."""
    profile = linear_profile(link_bytes_per_s=1e15, link_latency_s=0.0)
    n_tokens = 1000
    service = profile.prefill_s([(n_tokens, 0)])
    rho = 0.7
    requests = synthetic(40000, rho / service, (n_tokens, n_tokens), (1, 1), 16, seed=3)
    result = run(ClusterSpec(prefill=1, decode=1, max_num_batched_tokens=n_tokens), profile, requests)
    transfer = n_tokens * profile.kv_bytes_per_token / profile.num_layers / 1e15
    waits = [r.ttft - service - transfer for r in requests]
    expected = rho * service / (2 * (1 - rho))
    mean = sum(waits) / len(waits)
    assert result.summary["completed"] == len(requests)
    assert mean == pytest.approx(expected, rel=0.05)
    assert min(waits) == pytest.approx(0.0, abs=1e-9)


def test_one_request_ttft_is_the_sum_of_its_stages():
    """Two prefill chunks (budget 512), the KV tail that did not overlap the last step, then decode steps."""
    profile = linear_profile(link_bytes_per_s=2e9, link_latency_s=0.003)
    prompt, output = 1000, 4
    req = SimRequest(0, 0.5, prompt, output, chain_keys(range(prompt // 16), prompt // 16))
    run(ClusterSpec(prefill=1, decode=1, max_num_batched_tokens=512), profile, [req])
    step1 = profile.prefill_s([(512, 0)])
    step2 = profile.prefill_s([(488, 512)])
    nbytes = prompt * profile.kv_bytes_per_token
    layers = profile.num_layers
    tail = max(nbytes / layers, nbytes - 2e9 * step2 * (layers - 1) / layers) / 2e9
    assert req.ttft == pytest.approx(step1 + step2 + 0.003 + tail, rel=1e-9)
    decode = sum(profile.decode_s(1, prompt + g) for g in range(1, output))
    assert req.e2e == pytest.approx(req.ttft + decode, rel=1e-9)
    assert req.prompt_computed == prompt and req.kv_bytes == nbytes


def test_a_second_turn_computes_and_moves_only_its_new_blocks():
    profile = linear_profile()
    first_ids, more = list(range(10)), [100, 101, 102, 103]
    turn1 = SimRequest(0, 0.0, 10 * 16, 2, chain_keys(first_ids, 10))
    turn2 = SimRequest(1, 30.0, 14 * 16 + 5, 2, chain_keys(first_ids + more + [104], 14))
    run(ClusterSpec(prefill=1, decode=1, policy="kv_aware"), profile, [turn1, turn2])
    assert turn1.prompt_computed == 160
    assert turn2.prompt_computed == 4 * 16 + 5  # its 4 new full blocks and the partial one
    assert turn2.kv_bytes == (4 * 16 + 5) * profile.kv_bytes_per_token  # the decode worker holds the first turn's blocks


@pytest.mark.parametrize("policy", ["kv_aware", "round_robin"])
def test_a_local_prefill_threshold_counts_what_the_decode_worker_does_not_hold_under_kv_aware(policy):
    """The router's rule (router/policy.py `local_prefill_tokens`): a new turn of 69 tokens after 160 the decode
    worker holds runs on that worker under kv_aware; round_robin counts the whole 229-token prompt."""
    profile = linear_profile()
    first_ids, more = list(range(10)), [100, 101, 102, 103]
    turn1 = SimRequest(0, 0.0, 10 * 16, 2, chain_keys(first_ids, 10))
    turn2 = SimRequest(1, 30.0, 14 * 16 + 5, 2, chain_keys(first_ids + more + [104], 14))
    run(ClusterSpec(prefill=1, decode=1, policy=policy, local_prefill_threshold=100), profile, [turn1, turn2])
    assert turn1.prefill_worker == 0  # 160 tokens held nowhere: over the threshold
    if policy == "kv_aware":
        assert turn2.prefill_worker == -1 and turn2.prompt_computed == 4 * 16 + 5 and turn2.kv_bytes == 0
    else:
        assert turn2.prefill_worker == 0 and turn2.kv_bytes > 0


def test_a_prompt_fully_cached_still_computes_its_last_block():
    profile = linear_profile()
    ids = list(range(8))
    a = SimRequest(0, 0.0, 128, 2, chain_keys(ids, 8))
    b = SimRequest(1, 10.0, 128, 2, chain_keys(ids, 8))
    run(ClusterSpec(prefill=0, decode=1), profile, [a, b])
    assert b.prompt_computed == 16


def test_preemption_under_a_tiny_pool_conserves_requests():
    profile = linear_profile()
    requests = synthetic(40, 50.0, (40, 60), (60, 120), 16, seed=1)
    result = run(ClusterSpec(prefill=1, decode=1, kv_blocks=40), profile, requests)
    assert result.summary["preemptions"] > 0
    assert result.summary["completed"] == 40 and result.summary["rejected"] == 0
    assert all(r.generated == r.output_len for r in requests)
    preempted = [r for r in requests if r.preemptions]
    assert all(r.prompt_computed >= r.prompt_len for r in preempted)


def test_colocated_and_cpu_host_sharing():
    """Two workers on one core: a step of each runs at half speed while both are busy."""
    profile = linear_profile()
    a = SimRequest(0, 0.0, 500, 1, ())
    b = SimRequest(1, 0.0, 500, 1, ())
    run(ClusterSpec(prefill=0, decode=2, cores=1), profile, [a, b])
    assert a.ttft == pytest.approx(2 * profile.prefill_s([(500, 0)]))
    alone = SimRequest(0, 0.0, 500, 1, ())
    run(ClusterSpec(prefill=0, decode=2, cores=1), profile, [alone])
    assert alone.ttft == pytest.approx(profile.prefill_s([(500, 0)]))


def test_admission_backpressure_and_rejection():
    """Decode pools with room for one request at a time: the rest wait in admission, past the router's bound they are refused."""
    profile = linear_profile()
    requests = synthetic(20, 0.0, (100, 100), (50, 50), 16, seed=0)
    result = run(ClusterSpec(prefill=1, decode=1, kv_blocks=12, max_queued_requests=5), profile, requests)
    assert result.summary["rejected"] == 20 - 1 - 5
    assert result.summary["completed"] == 6


@pytest.mark.parametrize("policy", ["round_robin", "least_loaded", "prefix_aware", "kv_aware"])
def test_same_seed_same_result(policy):
    trace = select_window(load_trace(TRACE), requests=120, seed=0)
    scale = Scale(16)

    def once():
        reqs = from_trace(trace, scale, rate=2.0, slos_ms={"ttft": 6000, "tpot": 250})
        return run(ClusterSpec(prefill=2, decode=2, policy=policy, cores=2, tier_blocks=100), linear_profile(prefill_token_s=2e-3), reqs)

    first, second = once(), once()
    assert first.per_request() == second.per_request()
    assert first.summary == second.summary


def test_kv_aware_reuses_more_than_round_robin_on_the_trace():
    trace = select_window(load_trace(TRACE), requests=300, seed=0)
    scale = Scale(16)
    reuse = {}
    for policy in ("round_robin", "kv_aware"):
        reqs = from_trace(trace, scale, rate=1.0)
        reuse[policy] = run(ClusterSpec(prefill=4, decode=2, policy=policy), linear_profile(), reqs).summary["reuse"]
    assert reuse["kv_aware"] > reuse["round_robin"] + 0.05


def test_the_full_trace_at_256_gpus():
    """12,031 requests at their real times and lengths (512-token blocks) on 16 prefill + 16 decode workers of TP 8."""
    trace, scale = load_trace(TRACE), Scale(512, max_output=1 << 20)
    reqs = from_trace(trace, scale, slos_ms={"ttft": 2000, "tpot": 100})
    result = run(ClusterSpec(prefill=16, decode=16, prefill_tp=8, decode_tp=8, policy="kv_aware", block_tokens=512),
                 linear_profile(), reqs)
    assert result.spec.gpus == 256
    assert result.summary["completed"] == 12031
    bound = reuse_bound(trace, scale)["tokens"]  # an unbounded cache: 0.366 of the trace's blocks, a little more of its tokens
    assert 0.30 < result.summary["reuse"] <= bound


def test_sim_imports_no_torch():
    code = "import sys, sim.cluster, sim.command, sim.planner, sim.profile; print(','.join(m for m in ('torch', 'transformers', 'engine') if m in sys.modules) or '-')"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60, check=True).stdout.strip()
    assert out == "-"


def test_adaptive_controller_decisions_are_events():
    """Long prompts flood one prefill worker while two decode workers idle: the controller raises the local-prefill
    threshold, then moves a decode worker to prefill; every request still completes and nothing leaks."""
    from sim.adaptive import AdaptiveSettings

    profile = linear_profile(prefill_token_s=2e-3)
    requests = synthetic(300, 3.0, (300, 600), (4, 8), 16, seed=5, slos_ms={"ttft": 2000, "tpot": 100})
    settings = AdaptiveSettings(interval_s=2.0, window_s=6.0, ttft_slo_ms=2000, itl_slo_ms=100, step=256, max=256, hold=2, cooldown_s=6)
    result = run(ClusterSpec(prefill=1, decode=3, adaptive=settings), profile, requests)
    lanes = [(d["lane"], d["action"]) for d in result.decisions]
    assert ("threshold", "up") in lanes and ("split", "to_prefill") in lanes
    assert result.summary["completed"] == 300
    fixed = run(ClusterSpec(prefill=1, decode=3), profile, synthetic(300, 3.0, (300, 600), (4, 8), 16, seed=5,
                                                                      slos_ms={"ttft": 2000, "tpot": 100}))
    assert result.summary["goodput"] > fixed.summary["goodput"]

"""The simulator's model of how a worker shares its machine and its engine thread, against closed-form cases:
workers pinned one core each (only co-pinned workers slow each other), a profile's measured host sharing, the router's pool order, a decode
worker's reservation waiting for its step in progress, a mixed step paying the step's own cost once, the
second tier's copies (out on eviction, back on a decode worker's reservation) as engine-thread time, and a
chunk after cached keys costed on its own path. Every test ends with no KV block held anywhere."""

from __future__ import annotations

import dataclasses

import pytest

from sim.cluster import Cluster, ClusterSpec
from sim.core import Host, Sharing
from sim.profile import PROFILE_KIND, linear_profile, profile_from_dict
from sim.workload import SimRequest, chain_keys


def run(spec: ClusterSpec, profile, requests):
    cluster = Cluster(spec, profile)
    result = cluster.run(requests)
    for w in cluster.prefills + cluster.decodes:
        assert w.pool.used == 0 and not w.running and not w.waiting and not w.admission and not w.reserving and w.incoming == 0, w.index
    return cluster, result


def two_prompts() -> list[SimRequest]:
    return [SimRequest(0, 0.0, 500, 1, ()), SimRequest(1, 0.0, 500, 1, ())]


def test_pinned_workers_slow_only_the_workers_on_their_core():
    """Four colocated workers pinned on two cores (worker i on core i mod 2): two prompts on workers 0 and 1 run
    alone, on workers 0 and 2 they halve each other's speed; unpinned, two busy workers on two cores never slow."""
    profile = linear_profile()
    alone = profile.prefill_s([(500, 0)])
    apart = two_prompts()
    cluster, _ = run(ClusterSpec(prefill=0, decode=4, cores=2, pinned=True), profile, apart)
    assert [r.decode_worker for r in apart] == [0, 1]
    assert [r.ttft for r in apart] == pytest.approx([alone, alone])
    assert [len(h.workers) for h in {id(w.host): w.host for w in cluster.decodes}.values()] == [2, 2]
    together = two_prompts()
    run(ClusterSpec(prefill=0, decode=4, cores=2, pinned=True, pool_order=((), (0, 2, 1, 3))), profile, together)
    assert [r.decode_worker for r in together] == [0, 2]  # round_robin follows the router's pool order
    assert [r.ttft for r in together] == pytest.approx([2 * alone, 2 * alone])
    unpinned = two_prompts()
    run(ClusterSpec(prefill=0, decode=4, cores=2, pool_order=((), (0, 2, 1, 3))), profile, unpinned)
    assert [r.ttft for r in unpinned] == pytest.approx([alone, alone])


def test_measured_host_sharing_scales_steps_by_its_ratios():
    """A profile's host_sharing: two engines on one core run same_core x slower than alone (not 2x), an engine on
    the other core slows a step by other_core; unpinned, two busy workers on two cores pay the other-core ratio."""
    profile = dataclasses.replace(linear_profile(), same_core_ratio=2.2, other_core_ratio=1.1)
    alone = profile.prefill_s([(500, 0)])
    apart = two_prompts()
    run(ClusterSpec(prefill=0, decode=4, cores=2, pinned=True), profile, apart)
    assert [r.decode_worker for r in apart] == [0, 1]
    assert [r.ttft for r in apart] == pytest.approx([1.1 * alone, 1.1 * alone])
    together = two_prompts()
    run(ClusterSpec(prefill=0, decode=4, cores=2, pinned=True, pool_order=((), (0, 2, 1, 3))), profile, together)
    assert [r.ttft for r in together] == pytest.approx([2.2 * alone, 2.2 * alone]), "the other core idle: no other-core ratio"
    unpinned = two_prompts()
    run(ClusterSpec(prefill=0, decode=4, cores=2), profile, unpinned)
    assert [r.ttft for r in unpinned] == pytest.approx([1.1 * alone, 1.1 * alone])
    lone = [SimRequest(0, 0.0, 500, 1, ())]
    run(ClusterSpec(prefill=0, decode=4, cores=2, pinned=True), profile, lone)
    assert lone[0].ttft == pytest.approx(alone), "alone on the machine: the profile's own time"


def test_a_decode_step_pays_the_decode_ratios_of_host_sharing():
    """1P+1D pinned on two cores: a request decoding while the other core prefills a long prompt runs every step
    decode_other_core x slower (a decode step reads the whole model, so the neighbour costs it more than the prefill
    step's other_core); unmeasured, the decode ratios are the prefill step's."""
    measured = dataclasses.replace(linear_profile(), same_core_ratio=2.2, other_core_ratio=1.1,
                                   decode_same_core_ratio=2.6, decode_other_core_ratio=1.4)
    step = measured.decode_s(1, 17)

    def decoding_beside_a_prefill(profile) -> float:
        requests = [SimRequest(0, 0.0, 16, 21, ()), SimRequest(1, 0.0, 8000, 1, ())]
        run(ClusterSpec(prefill=1, decode=1, cores=2, pinned=True), profile, requests)
        assert requests[1].first_token > requests[0].finish, "the decode ran while the other core prefilled"
        return requests[0].tpot

    assert decoding_beside_a_prefill(measured) == pytest.approx(1.4 * step, rel=0.02)
    assert decoding_beside_a_prefill(dataclasses.replace(measured, decode_same_core_ratio=None, decode_other_core_ratio=None)) \
        == pytest.approx(1.1 * step, rel=0.02)
    assert measured.sharing()[1] == Sharing(2.6, 1.4)
    shared, other = Host(1, *measured.sharing()), Host(1, *measured.sharing())
    shared.peers, other.peers = [other], [shared]
    shared.busy, other.busy = {0, 1}, {2}
    assert (shared.factor(decoding=True), shared.factor()) == pytest.approx((2.6 * 1.4, 2.2 * 1.1))


def test_host_sharing_ratios_are_checked():
    data = {"kind": PROFILE_KIND, "block_size": 16, "num_layers": 30, "kv_bytes_per_token": 1000, "kv_capacity_tokens": 4096,
            "prefill": {"tokens": [16, 64], "context": [0], "seconds": [[0.01], [0.02]]},
            "decode": {"batch": [1, 2], "context": [16], "seconds": [[0.01], [0.011]]},
            "transfer": {"tcp": {"latency_s": 0.001, "bytes_per_s": 1e9}}}
    data["host_sharing"] = {"same_core": 2.1, "other_core": 0.5}
    with pytest.raises(ValueError, match="host_sharing.other_core"):
        profile_from_dict(data)
    data["host_sharing"] = {"same_core": 2.1, "other_core": 1.02, "decode_other_core": 0.9}
    with pytest.raises(ValueError, match="host_sharing.decode_other_core"):
        profile_from_dict(data)
    data["host_sharing"] = {"same_core": 2.1, "other_core": 1.02, "decode_same_core": 2.3, "decode_other_core": 1.3}
    assert profile_from_dict(data).sharing() == (Sharing(2.1, 1.02), Sharing(2.3, 1.3))
    del data["host_sharing"]["decode_same_core"], data["host_sharing"]["decode_other_core"]
    assert profile_from_dict(data).sharing() == (Sharing(2.1, 1.02), Sharing(2.1, 1.02)), "a decode step: the prefill's when unmeasured"
    del data["host_sharing"]
    assert (profile_from_dict(data).same_core_ratio, profile_from_dict(data).other_core_ratio) == (2.0, 1.0), "fair sharing when unmeasured"


def test_a_pool_order_must_name_every_worker():
    with pytest.raises(ValueError, match="pool_order"):
        Cluster(ClusterSpec(prefill=1, decode=2, pool_order=((0,), (0, 0))), linear_profile())


def test_a_reservation_waits_for_the_decode_step_in_progress():
    """The decode worker reserves blocks on its engine thread, between steps: a request arriving 30 % into the
    decode worker's second step of another request is admitted when that step ends, then prefilled."""
    profile = linear_profile(decode_fixed_s=0.2, link_bytes_per_s=1e15, link_latency_s=0.0)
    first = SimRequest(0, 0.0, 16, 20, chain_keys([1], 1))
    step1, step2 = profile.decode_s(1, 17), profile.decode_s(1, 18)
    t_first = profile.prefill_s([(16, 0)])
    arrival = t_first + step1 + 0.3 * step2
    second = SimRequest(1, arrival, 32, 2, chain_keys([2, 3], 2))
    run(ClusterSpec(prefill=1, decode=1), profile, [first, second])
    assert first.ttft == pytest.approx(t_first, rel=1e-6)
    assert second.stage_s["decode_admission_s"] == pytest.approx(0.7 * step2, rel=1e-6)
    assert second.ttft == pytest.approx(0.7 * step2 + profile.prefill_s([(32, 0)]), rel=1e-6)
    idle = SimRequest(0, 0.0, 32, 2, chain_keys([2, 3], 2))
    run(ClusterSpec(prefill=1, decode=1), profile, [idle])
    assert idle.stage_s["decode_admission_s"] == 0.0


def test_a_mixed_step_pays_the_step_overhead_once():
    """One forward for prefill chunks and decodes: the decodes add their per-request cost (the decode grid's slope
    at its largest batches), not a second step's fixed part."""
    p = linear_profile(prefill_fixed_s=0.05, prefill_token_s=1e-3, decode_fixed_s=0.02, decode_seq_s=2e-3, attention_token_s=1e-6)
    assert p.decode_row_s(300) == pytest.approx(2e-3 + 300 * 1e-6)
    mixed = p.prefill_s([(100, 0)], decode_batch=4, decode_context=300)
    assert mixed == pytest.approx(0.05 + 100 * 1e-3 + 4 * (2e-3 + 300 * 1e-6))
    assert mixed < p.prefill_s([(100, 0)]) + p.decode_s(4, 300)


def test_tier_copies_are_engine_thread_time():
    """Pools of 10 blocks with a second tier, 10 ms per block moved: a prompt whose reservation (10 blocks: the
    prompt and its next token) evicts the first prompt's 4 cached blocks waits 40 ms for their copies on the
    decode worker, and its prefill step (9 blocks: 3 evicted) pays 30 ms for the prefill worker's; a later prompt whose blocks the decode worker's tier holds loads them there (no bytes move
    for them) and waits for those loads and the copies of what they evict."""
    profile = dataclasses.replace(linear_profile(link_bytes_per_s=1e15, link_latency_s=0.0), tier_load_s_per_block=0.01)
    assert profile.tier_block_s == 0.01
    spec = ClusterSpec(prefill=1, decode=1, kv_blocks=10, tier_blocks=100)
    a = SimRequest(0, 0.0, 64, 2, chain_keys(range(4), 4))
    b = SimRequest(1, 10.0, 144, 2, chain_keys(range(100, 109), 9))
    c = SimRequest(2, 20.0, 64, 2, chain_keys(range(4), 4))
    cluster, _ = run(spec, profile, [a, b, c])
    assert a.stage_s["decode_admission_s"] == 0.0
    assert b.stage_s["decode_admission_s"] == pytest.approx(0.04)
    assert b.stage_s["prefill_compute_s"] == pytest.approx(profile.prefill_s([(144, 0)]) + 0.03)
    assert c.kv_bytes == 16 * profile.kv_bytes_per_token  # its first 3 blocks came back from the decode worker's tier
    assert c.stage_s["decode_admission_s"] == pytest.approx(0.03 + 0.04)
    assert cluster.decodes[0].pool.stored == 8


def test_a_chunk_after_cached_keys_is_read_from_the_cached_path():
    """The engine attends a whole prompt (no cached context) by another path than a chunk after cached keys, and
    the profile measures both: a 300-token chunk after 16 cached tokens costs what the positive-context columns say
    (extrapolated to 16), not a 16/256 share of the step from context 0 to 256."""
    tokens, context = [16, 128, 512], [0, 256, 512, 1024]

    def t(n: int, c: int) -> float:  # 20 ms + 1 ms a token; any context: +0.2 ms a token, + 1 us a token per cached one
        return 0.02 + n * 1e-3 + (n * 2e-4 + n * c * 1e-6 if c else 0.0)

    p = profile_from_dict({"kind": PROFILE_KIND, "block_size": 16, "num_layers": 30, "kv_bytes_per_token": 1000, "kv_capacity_tokens": 4096,
                           "prefill": {"tokens": tokens, "context": context, "seconds": [[t(n, c) for c in context] for n in tokens]},
                           "decode": {"batch": [1, 2], "context": [16, 1024], "seconds": [[0.01, 0.011], [0.012, 0.013]]},
                           "transfer": {"tcp": {"latency_s": 0.001, "bytes_per_s": 1e9}}})
    assert p.prefill_s([(300, 16)]) == pytest.approx(t(300, 16))
    assert p.prefill_s([(300, 0)]) == pytest.approx(t(300, 0))
    assert p.prefill_s([(300, 600)]) == pytest.approx(t(300, 600))
    assert p.prefill_s([(200, 0), (100, 16)]) == pytest.approx(t(300, 0) + t(100, 16) - t(100, 0))

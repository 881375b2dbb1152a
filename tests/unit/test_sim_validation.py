"""The validation harness's own logic on the runs committed in bench/results: the simulated requests are the
ones the real run sent (same window, lengths and hash ids), each case is simulated with the profile of its
run's CPU kind and dtype (a run from another machine kind is not judged), pools are sized by the profile's
bytes per block, setups the simulator does not model are listed, and a round_robin run's decode order is read
back from its workers' counters."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from bench.experiments import sim_validation
from sim.cluster import ClusterSpec
from sim.profile import linear_profile, load_profile

RESULTS = Path(__file__).resolve().parents[2] / "bench" / "results"
TRACE = Path("/work/shared/traces/mooncake_conversation_trace.jsonl")
ZEN4 = {"cpu": "AMD EPYC", "cpu_features": ["avx2", "avx512f", "avx512_vnni", "avx512_bf16"], "cpu_auto_dtype": "bfloat16"}
AVX2 = {"cpu": "AMD EPYC", "cpu_features": ["avx2"], "cpu_auto_dtype": "float32"}


def profile_of(machine: dict, dtype: str, name: str, kv_bytes_per_token: int = 46080):
    return dataclasses.replace(linear_profile(), machine=machine, dtype=dtype, path=f"/x/{name}.json", kv_bytes_per_token=kv_bytes_per_token,
                               estimate=False)


@pytest.mark.skipif(not (RESULTS / "trace_replay_requests.json").exists() or not TRACE.exists(), reason="needs the committed trace replay")
def test_trace_cases_replay_the_real_requests():
    run = json.loads((RESULTS / "trace_replay.json").read_text())
    cases, skipped = sim_validation.trace_cases(RESULTS / "trace_replay.json", RESULTS / "trace_replay_requests.json")
    ran = {name for name, r in run["results"].items() if r.get("status") == "ran"}
    assert {c["config"] for c in cases} == ran & set(sim_validation.TRACE_CONFIGS)
    assert all("kv_pull" in why for name, why in skipped.items() if name.endswith("+pull"))
    case = cases[0]
    assert len(case["requests"]) == len(case["records"])
    assert all(len(keys) == prompt // 16 for _, prompt, _, keys in case["requests"])
    assert (case["spec"].prefill, case["spec"].decode) == (run["cluster"]["prefill"], run["cluster"]["decode"])
    assert case["spec"].cores == 2 and case["spec"].pinned
    profile = sim_validation.profile_for(case, sim_validation.shipped_profiles())
    row = sim_validation.compare(case, profile)
    assert row["real"]["requests"] == row["sim"]["requests"] == len(case["records"])
    assert set(row["errors"]) == set(sim_validation.BOUNDS) and all(e is not None for e in row["errors"].values())
    assert set(row["stages_ms"]) == set(sim_validation.STAGES)
    if row["not_comparable"] is None:  # a profile of the run's machine kind is shipped: the pools are its dtype's
        assert row["kv_blocks"] == run["cluster"]["kv_blocks_per_worker"]


def test_adaptive_cases_are_the_validations_own_runs_not_the_adaptive_benchmarks():
    """The validation reads its adaptive shapes from sim_validation_adaptive_<config>.json (where its runs go), never from
    adaptive_trace_<config>.json, the adaptive benchmark's fixed shapes judged beside its adaptive configs."""
    cases = sim_validation.adaptive_cases(RESULTS)
    assert [c["config"] for c in cases] == list(sim_validation.ADAPTIVE_CONFIGS)
    for case in cases:
        own = json.loads((RESULTS / f"{sim_validation.ADAPTIVE_RESULTS}_{case['config']}.json").read_text())
        assert case["records"] == own["requests"]
        assert (case["spec"].prefill, case["spec"].decode) == sim_validation.ADAPTIVE_CONFIGS[case["config"]]
    assert sim_validation.adaptive_cases(RESULTS / "no such directory") == []


def test_each_workload_picks_among_its_shapes_and_the_trace_among_kv_aware_rows():
    def row(workload, config, real, sim):
        return {"workload": workload, "config": config, "not_comparable": None, "real": {"goodput": real}, "sim": {"goodput": sim}}

    rows = [row("trace", "1p2d round_robin", 9.0, 9.0), row("trace", "1p2d kv_aware", 1.0, 1.5), row("trace", "1p2d kv_aware+tier", 8.0, 8.0),
            row("trace", "1p1d kv_aware", 2.0, 1.2), row("trace", "colocated kv_aware", 1.5, 1.1),
            row("adaptive", "colocated", 0.9, 0.8), row("adaptive", "1p1d", 0.8, 0.85)]
    picks = sim_validation.picks(rows)
    assert picks["trace"]["real_best"] == "1p1d kv_aware" and picks["trace"]["sim_best"] == "1p2d kv_aware" and not picks["trace"]["same"]
    assert set(picks["trace"]["goodput"]) == {"1p2d kv_aware", "1p1d kv_aware", "colocated kv_aware"}
    assert picks["adaptive"]["real_best"] == "colocated" and picks["adaptive"]["sim_best"] == "1p1d"
    assert sim_validation.picks(rows[:1])["trace"] is None


def test_another_machine_kind_is_not_judged():
    profile = load_profile(sim_validation.DEFAULT_PROFILE)
    same = dict(profile.machine)
    assert sim_validation.comparable(same, "float32", profile) is None
    assert "dtype" in sim_validation.comparable(same, "bfloat16", profile)
    other = {**same, "cpu_features": ["avx2", "avx512_bf16"]}
    assert "CPU" in sim_validation.comparable(other, "auto", profile)


def test_each_case_gets_the_profile_of_its_cpu_and_dtype():
    profiles = [profile_of(AVX2, "float32", "avx2_fp32"), profile_of(ZEN4, "float32", "zen4_fp32"), profile_of(ZEN4, "bfloat16", "zen4_bf16", 23040)]
    pick = sim_validation.profile_for
    assert Path(pick({"machine": ZEN4, "dtype": None}, profiles).path).stem == "zen4_bf16"  # engine dtype auto: bf16 on this CPU
    assert Path(pick({"machine": ZEN4, "dtype": "float32"}, profiles).path).stem == "zen4_fp32"
    assert Path(pick({"machine": AVX2, "dtype": "auto"}, profiles).path).stem == "avx2_fp32"
    closest = pick({"machine": AVX2, "dtype": "bfloat16"}, profiles)  # same CPU kind, another dtype: shown, not judged
    assert Path(closest.path).stem == "avx2_fp32" and "dtype" in sim_validation.comparable(AVX2, "bfloat16", closest)
    xeon = {"cpu": "Intel Xeon", "cpu_features": ["avx2", "amx_bf16"], "cpu_auto_dtype": "bfloat16"}
    fallback = pick({"machine": xeon, "dtype": None}, profiles)
    assert "CPU" in sim_validation.comparable(xeon, None, fallback)


def test_pools_are_sized_by_the_profiles_bytes_per_block():
    """engine/kv_tier.py: budget // bytes per block; the KV pool likewise from its megabytes."""
    case = {"spec": ClusterSpec(block_tokens=16), "kv_cache_mb": 512, "tier_mb": 1024}
    bf16 = profile_of(ZEN4, "bfloat16", "zen4_bf16", 23040)
    spec = sim_validation.spec_for(case, bf16)
    assert (spec.kv_blocks, spec.tier_blocks) == ((512 << 20) // (23040 * 16), (1024 << 20) // (23040 * 16)) == (1456, 2912)
    fp32 = sim_validation.spec_for(case, profile_of(ZEN4, "float32", "zen4_fp32", 46080))
    assert (fp32.kv_blocks, fp32.tier_blocks) == (728, 1456)
    assert sim_validation.spec_for({"spec": ClusterSpec(kv_blocks=364)}, bf16).kv_blocks == 364


def test_setups_the_simulator_does_not_model_are_named():
    assert sim_validation.unsupported({"policy": "kv_aware", "overrides": {}}) is None
    assert sim_validation.unsupported({"policy": "kv_aware", "overrides": {"engine": {"kv_tier": {"kind": "memory", "budget_mb": 1024}}}}) is None
    assert "kv_pull" in sim_validation.unsupported({"policy": "kv_aware", "overrides": {"router": {"kv_pull": True}}})
    assert "memory tier" in sim_validation.unsupported({"policy": "kv_aware", "overrides": {"engine": {"kv_tier": {"kind": "disk"}}}})
    assert "policy" in sim_validation.unsupported({"policy": "fancy", "overrides": {}})


def test_a_round_robin_runs_decode_order_is_read_from_its_counters():
    """Requests alternate over the router's decode pool in arrival order; decode1 decoded the 1st, 3rd, ... answers."""
    records = [{"scheduled_s": float(i), "max_tokens": m} for i, m in enumerate([11, 3, 21, 5])]
    workers = {"decode0": {"generation_tokens": 2 + 4}, "decode1": {"generation_tokens": 10 + 20 + 1}}  # +1: a shadow recompute
    assert sim_validation.round_robin_decode_order(records, workers, 2) == (1, 0)
    assert sim_validation.round_robin_decode_order(records, {"decode0": {"generation_tokens": 30}, "decode1": {"generation_tokens": 6}}, 2) == (0, 1)
    assert sim_validation.round_robin_decode_order(records, {}, 2) is None


def test_the_simulated_kv_hand_over_is_the_runs():
    assert not sim_validation.streamed_layerwise({"transport": "tcp"})  # unset: after the prompt on a CPU
    assert sim_validation.streamed_layerwise({"layerwise": True}) and not sim_validation.streamed_layerwise({"layerwise": False})

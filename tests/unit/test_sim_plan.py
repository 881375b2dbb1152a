"""Profiles (loading, interpolation, the shipped ones, `pdserve profile --quick` on the real engine) and
`pdserve plan` (the search's pick, the written config passing the loader, the first line of its output)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from common.config import load_config
from sim.cluster import ClusterSpec
from sim.planner import Goal, Limits, Planner
from sim.profile import SHIPPED, linear_profile, load_profile, profile_from_dict
from sim.workload import synthetic

REPO = Path(__file__).resolve().parents[2]


def test_grid_interpolates_bilinearly_and_extrapolates_linearly():
    p = linear_profile(prefill_fixed_s=0.01, prefill_token_s=1e-3, attention_token_s=1e-6)
    assert p.prefill.at(512, 0) == pytest.approx(0.01 + 0.512)
    assert p.prefill.at(300, 1000) == pytest.approx(0.01 + 0.3 + 300 * 1000 * 1e-6)
    assert p.prefill.at(65536, 0) == pytest.approx(0.01 + 65.536)  # past the last point
    assert p.prefill_s([(100, 0), (200, 50)]) == pytest.approx(0.01 + 0.3 + 200 * 50 * 1e-6)
    assert p.decode_s(8, 100, tp=2) == pytest.approx(p.decode_s(8, 100) / (2 * 0.9))
    with pytest.raises(ValueError, match="tensor_parallel_size 3"):
        p.speedup(3)


def test_bad_profiles_name_the_field(tmp_path):
    good = json.loads((SHIPPED / "gpu_h200_llama8b_bf16_estimate.json").read_text())
    for path, value, field in ((("decode", "seconds"), [[1.0]], "profile.decode.seconds"), (("prefill", "tokens"), [5, 1], "profile.prefill.tokens"),
                               (("transfer",), {}, "profile.transfer"), (("kv_bytes_per_token",), 0, "profile.kv_bytes_per_token")):
        data = json.loads(json.dumps(good))
        target = data
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = value
        with pytest.raises(ValueError, match=field.replace(".", r"\.")):
            profile_from_dict(data)


def test_shipped_profiles_load_and_say_what_they_are():
    names = sorted(p.stem for p in SHIPPED.glob("*.json"))
    assert "gpu_h200_llama8b_bf16_estimate" in names and any(n.startswith("cpu_") for n in names)
    for name in names:
        profile = load_profile(name)
        assert profile.source
        assert profile.estimate == name.endswith("_estimate")
        assert profile.prefill_s([(512, 0)]) > profile.prefill_s([(16, 0)]) > 0
    gpu = load_profile("gpu_h200_llama8b_bf16_estimate")
    assert "ESTIMATE" in gpu.source and "Assumed" in gpu.source and gpu.device == "cuda"


def test_profile_quick_measures_the_real_engine(tmp_path):
    out = tmp_path / "p.json"
    result = subprocess.run([sys.executable, "-m", "deploy.cli", "profile", "--quick", "--out", str(out)], cwd=REPO, capture_output=True,
                            text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stderr[-2000:]
    profile = load_profile(out)
    assert profile.kv_bytes_per_token == 30 * 3 * 64 * 4 * 2  # SmolLM2-135M in fp32
    assert profile.block_size == 16 and profile.num_layers == 30 and profile.threads == 1
    assert profile.prefill.at(64, 0) > profile.prefill.at(16, 0)
    assert json.loads(out.read_text())["machine"]["cpu"]


def _workload(f: float):
    return synthetic(300, 8.0 * f, (200, 400), (10, 20), 16, seed=2, slos_ms={"ttft": 500, "tpot": 50})


def test_the_plan_is_the_fewest_accelerators_that_meet_the_goal():
    profile = linear_profile(prefill_token_s=5e-4)  # a 300-token prompt ~0.16 s: 8 req/s needs more than one prefill worker
    planner = Planner(profile, _workload, Goal({"ttft": 500, "tpot": 50}), Limits(5, ("round_robin", "least_loaded"), (1,)))
    plan = planner.search()
    assert plan.chosen is not None and plan.chosen.meets
    assert len(plan.candidates) == len(planner.shapes())  # few shapes: every one simulated
    assert all(not c.meets for c in plan.candidates if c.spec.gpus < plan.chosen.spec.gpus)
    assert plan.chosen.spec.gpus >= 2
    assert set(plan.chosen.by_rate) == {"0.5", "0.75", "1", "1.25", "1.5"}
    assert plan.chosen.by_rate["0.5"]["attainment"] >= plan.chosen.by_rate["1.5"]["attainment"]


def test_the_large_search_matches_the_exhaustive_one():
    profile = linear_profile(prefill_token_s=5e-4)
    limits = Limits(5, ("round_robin",), (1,))
    exhaustive = Planner(profile, _workload, Goal({"ttft": 500, "tpot": 50}), limits).search()
    searched = Planner(profile, _workload, Goal({"ttft": 500, "tpot": 50}), Limits(5, ("round_robin",), (1,), exhaustive=0)).search()
    assert searched.chosen.spec.gpus == exhaustive.chosen.spec.gpus
    assert any(c.spec.prefill and c.spec.decode == 2 for c in searched.candidates)  # prefill sized beside the generous decode pool
    assert searched.simulations < exhaustive.simulations


def test_pdserve_plan_writes_a_config_serve_accepts(tmp_path):
    out = tmp_path / "plan.yaml"
    result = subprocess.run([sys.executable, "-m", "deploy.cli", "plan", "--profile", "gpu_h200_llama8b_bf16_estimate", "--rate", "3",
                             "--num-requests", "200", "--prompt-len", "1000", "4000", "--output-len", "50", "200", "--slo-ttft", "2000",
                             "--slo-itl", "100", "--max-gpus", "8", "--tp", "1", "2", "--out", str(out)],
                            cwd=REPO, capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.splitlines()[0] == f"pdserve serve -c {out}"
    config = load_config(out)
    report = json.loads(out.with_suffix(".report.json").read_text())
    chosen = report["chosen"]
    assert config.pools.decode.replicas * config.pools.decode.tensor_parallel_size + \
        config.pools.prefill.replicas * config.pools.prefill.tensor_parallel_size == chosen["gpus"]
    assert config.router.policy == chosen["policy"] and config.engine.device == "cuda"


def test_no_plan_when_nothing_fits(tmp_path):
    result = subprocess.run([sys.executable, "-m", "deploy.cli", "plan", "--profile", "gpu_h200_llama8b_bf16_estimate", "--rate", "50",
                             "--num-requests", "200", "--prompt-len", "8000", "8000", "--output-len", "50", "50", "--slo-ttft", "100",
                             "--slo-itl", "10", "--max-gpus", "2", "--out", str(tmp_path / "x.yaml")],
                            cwd=REPO, capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 3 and "no plan" in result.stderr
    assert not (tmp_path / "x.yaml").exists()


def test_spec_counts_accelerators():
    assert ClusterSpec(prefill=2, decode=3, prefill_tp=8, decode_tp=4).gpus == 28
    assert ClusterSpec(prefill=0, decode=2).name().startswith("colocated")

"""The validation harness's own logic on the runs committed in bench/results: the simulated requests are the
ones the real run sent (same window, lengths and hash ids), and a run from another machine kind is not judged."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.experiments import sim_validation
from sim.profile import load_profile

RESULTS = Path(__file__).resolve().parents[2] / "bench" / "results"
TRACE = Path("/work/shared/traces/mooncake_conversation_trace.jsonl")


@pytest.mark.skipif(not (RESULTS / "trace_replay_requests.json").exists() or not TRACE.exists(), reason="needs the committed trace replay")
def test_trace_cases_replay_the_real_requests():
    cases = sim_validation.trace_cases(RESULTS / "trace_replay.json", RESULTS / "trace_replay_requests.json")
    assert {c["config"] for c in cases} == set(sim_validation.TRACE_CONFIGS)
    case = cases[0]
    assert len(case["requests"]) == len(case["records"])
    assert all(len(keys) == prompt // 16 for _, prompt, _, keys in case["requests"])
    cluster = json.loads((RESULTS / "trace_replay.json").read_text())["cluster"]
    assert (case["spec"].prefill, case["spec"].decode) == (cluster["prefill"], cluster["decode"])
    assert case["spec"].cores == 2
    row = sim_validation.compare(case, load_profile(sim_validation.DEFAULT_PROFILE))
    assert row["real"]["requests"] == row["sim"]["requests"] == len(case["records"])
    assert set(row["errors"]) == set(sim_validation.BOUNDS) and all(e is not None for e in row["errors"].values())


def test_another_machine_kind_is_not_judged():
    profile = load_profile(sim_validation.DEFAULT_PROFILE)
    same = dict(profile.machine)
    assert sim_validation.comparable(same, "float32", profile) is None
    assert "dtype" in sim_validation.comparable(same, "bfloat16", profile)
    other = {**same, "cpu_features": ["avx2", "avx512_bf16"]}
    assert "CPU" in sim_validation.comparable(other, "auto", profile)

"""bench.experiments.kv_tier --quick: both sides measured at every length and kind, the crossover derived
from them, its history line written (to tmp_path: a test writes nothing under the repository)."""

from __future__ import annotations

import json

import pytest

from bench.experiments import common, kv_tier


@pytest.fixture
def quick_results_in_tmp(monkeypatch, tmp_path):
    monkeypatch.setattr(common, "use_quick_results", lambda: monkeypatch.setattr(common, "RESULTS", tmp_path))


def test_quick_run_measures_loading_and_computing(quick_results_in_tmp):
    assert kv_tier.main(["--quick", "--kinds", "memory", "disk"]) == 0
    report = json.loads((common.RESULTS / "kv_tier.json").read_text())
    for kind in ("memory", "disk"):
        rows = report["results"][kind]
        assert sorted(rows, key=int) == ["16", "64"]
        assert all(row["computed_s"] > 0 and row["loaded_s"] > 0 for row in rows.values())
        assert report["loading_wins_from_tokens"][kind] == kv_tier.crossover(rows)
    history = [json.loads(line) for line in (common.RESULTS / "history.jsonl").read_text().splitlines()]
    assert history[-1]["experiment"] == "kv_tier" and "loading_wins_from_tokens" in history[-1]["headline"]


def test_crossover_is_the_shortest_length_from_which_loading_always_wins():
    rows = {"16": {"computed_s": 1, "loaded_s": 2}, "32": {"computed_s": 2, "loaded_s": 1},
            "64": {"computed_s": 1, "loaded_s": 3}, "128": {"computed_s": 5, "loaded_s": 1}}
    assert kv_tier.crossover(rows) == 128
    assert kv_tier.crossover({"16": {"computed_s": 1, "loaded_s": 2}}) is None

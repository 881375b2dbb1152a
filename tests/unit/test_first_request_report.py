"""docs/benchmarks/serving.md's first-request table, rendered from the experiment's JSON."""

from __future__ import annotations

from bench.experiments.report import SECTIONS, section, section_first_request


def test_table_row_per_cluster_names_the_stages_that_paid_the_cold_extra():
    report = {
        "command": "python -m bench.experiments.first_request",
        "params": {"quick": False},
        "machine": {"cpus": 2, "cpu": "test CPU", "torch": "2.13.0", "git_commit": "abc1234", "loadavg_start": [0.1],
                    "loadavg_end": [0.2], "duration_s": 1.0},
        "results": [{"transport": "ucx", "first_wall_s": 0.633, "later_wall_median_s": 0.197, "cold_extra_s": 0.436,
                     "cold_extra_by_stage_s": {"prefill_compute": 0.429, "decode": 0.004, "other": -0.001}}],
    }
    lines = section_first_request(report)
    assert "| ucx | 633 | 197 | 436 | prefill_compute 429 |" in lines
    assert any("commit abc1234" in line for line in lines)


def test_missing_results_say_how_to_make_them():
    lines = section("A fresh cluster's first request", "first_request", section_first_request, None)
    assert lines[0] == "## A fresh cluster's first request"
    assert "Not run yet: `python -m bench.experiments.first_request`." in lines
    assert ("A fresh cluster's first request", "first_request", section_first_request) in SECTIONS

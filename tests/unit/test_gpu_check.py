"""The device check's pieces, run cheaply on CPU so they don't rot between device runs.

The harness (budgets, partial JSON, statuses), the summary over partial results, and the quick
settings' correctness, decode-step and KV-between-processes sections on tiny models. The whole quick
run (`python -m bench.gpu_check --quick --device cpu`, which also starts the router and workers) is
what scripts/gpu_check.sh runs; it takes minutes, so it is not repeated here.
"""

from __future__ import annotations

import json
import time

import pytest
import torch

from bench import gpu_check
from bench.gpu import ipc, probe, sections
from bench.gpu.harness import Report, Skip
from bench.gpu.settings import quick


def test_report_keeps_every_section_status_and_writes_after_each(tmp_path):
    report = Report(tmp_path / "r.json", {"machine": "x"})
    report.section("good", 5, lambda: {"value": 1})
    assert json.loads((tmp_path / "r.json").read_text())["sections"]["good"]["value"] == 1
    report.section("bad", 5, lambda: 1 / 0)
    report.section("skipped", 5, lambda: (_ for _ in ()).throw(Skip("no cuda")))
    report.section("slow", 0.3, lambda: time.sleep(3))
    data = json.loads((tmp_path / "r.json").read_text())["sections"]
    assert [data[k]["status"] for k in ("good", "bad", "skipped", "slow")] == ["ok", "error", "skip", "timeout"]
    assert "ZeroDivisionError" in data["bad"]["error"] and data["skipped"]["reason"] == "no cuda"
    assert data["slow"]["seconds"] < 2


def test_summary_tolerates_missing_and_failed_sections():
    partial = {
        "correctness": {"status": "ok", "fp32_identical": True, "bfloat16": {"identical_share": 0.9}},
        "engine_throughput": {"status": "ok", "tokens_per_s": 1000.0},
        "hf_static": {"status": "ok", "tokens_per_s": 100.0},
        "hf_continuous": {"status": "timeout", "error": "ran past its budget"},
    }
    summary = gpu_check.summarize(partial)
    assert summary["engine_over_hf_static"] == 10.0 and summary["engine_over_hf_continuous"] is None
    assert summary["fp32_identical"] is True and summary["decode_fraction_of_bound"] is None
    text = gpu_check.summary_text({"machine": {"cpu": "x", "torch": "t", "transformers": "v"}, "summary": summary, "sections": partial})
    assert "engine_over_hf_static: 10.0" in text and "hf_continuous FAILED: ran past its budget" in text


def test_unknown_section_is_rejected_by_name():
    with pytest.raises(SystemExit):
        gpu_check.main(["--sections", "correctness,nonsense", "--device", "cpu"])


def test_quick_correctness_section_matches_hf_on_cpu(demo_model):
    result = sections.section_correctness(quick("cpu"))
    assert result["fp32_identical"], result["float32"]
    assert result["bfloat16"]["prompts"] == 3


def test_quick_decode_section_measures_every_batch_against_the_bound(demo_model):
    result = sections.section_decode_step(sections.Models(quick("cpu")))
    assert set(result["batches"]) == {"1", "4"}
    for entry in result["batches"].values():
        assert entry["bound_ms"] > 0 and entry["timings"]["engine_step"]["ms_median"] > 0
        assert 0 < entry["fraction_of_bound"]["engine_step"]


def test_kv_blocks_cross_processes_intact():
    result = ipc.ipc_copy("cpu", num_blocks=16, block_numel=256, dtype=torch.bfloat16, iters=2)
    assert result["bytes_identical"] and result["bytes"] == 8 * 256 * 2


def test_probe_cuda_checks_skip_without_cuda():
    if torch.cuda.is_available():
        pytest.skip("CUDA present: the probe runs these checks for real")
    for check in (probe.check_flex_attention, probe.check_decode_graph, probe.check_memcpy, probe.check_ipc, probe.check_triton_kernel):
        with pytest.raises(Skip):
            check("cpu")

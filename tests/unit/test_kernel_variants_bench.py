"""bench.experiments.kernel_variants: every variant's edits still match the kernels' sources (a variant that
silently stopped applying would time the current kernel against itself), and `--quick` runs end to end on
the engine's own build. No speed is asserted; building the variants (minutes) is left to the experiment."""

import json
import subprocess

import pytest

from bench.experiments import common, kernel_variants
from engine import kernels


@pytest.mark.parametrize("name", [n for n in kernel_variants.VARIANTS if n != "current"])
def test_each_variant_edits_the_current_source(name):
    edited = kernel_variants.variant_sources(name)
    for file, old, new in kernel_variants.VARIANTS[name]:
        assert edited[file] != (kernels.FOLDER / file).read_text()
        assert old not in edited[file] and (not new or new in edited[file])


def test_an_edit_that_no_longer_matches_fails_loudly(monkeypatch):
    monkeypatch.setitem(kernel_variants.VARIANTS, "stale", (("paged_attention.cpp", "a line the kernel does not have", ""),))
    with pytest.raises(ValueError, match="stale"):
        kernel_variants.variant_sources("stale")


def test_against_takes_the_kernels_of_a_git_revision():
    texts = kernel_variants.revision_sources("HEAD")
    assert set(texts) == set(kernels.SOURCES + kernels.HEADERS)
    assert "paged_decode" in texts["paged_attention.cpp"]
    with pytest.raises(ValueError, match="no_such_revision"):
        kernel_variants.revision_sources("no_such_revision")


def test_a_revision_before_a_source_was_added_leaves_it_out():
    added = subprocess.run(["git", "log", "--diff-filter=A", "--format=%H", "--", "engine/kernels/rotary.cpp"], cwd=common.REPO,
                           capture_output=True, text=True, timeout=30).stdout.split()
    if not added:
        pytest.skip("git here has no history of engine/kernels/rotary.cpp (a shallow clone, or not committed yet)")
    texts = kernel_variants.revision_sources(f"{added[-1]}~1")
    assert "rotary.cpp" not in texts
    assert "paged_decode" in texts["paged_attention.cpp"] and "bindings.cpp" in texts


def test_unknown_variant_is_a_usage_error(capsys):
    with pytest.raises(SystemExit):
        kernel_variants.main(["--quick", "--variants", "current,no_such_variant"])
    assert "no_such_variant" in capsys.readouterr().err


@pytest.fixture
def quick_results_in_tmp(monkeypatch, tmp_path):
    """--quick results go to tmp_path, not bench/results/quick: a test writes nothing under the repository."""
    monkeypatch.setattr(common, "use_quick_results", lambda: monkeypatch.setattr(common, "RESULTS", tmp_path))


@pytest.mark.skipif(kernels.load() is None, reason="the C++ kernels need a compiler")
def test_quick_run_times_every_case_and_dtype(quick_results_in_tmp):
    assert kernel_variants.main(["--quick", "--variants", "current", "--threads", "1"]) == 0
    report = json.loads((common.RESULTS / "kernel_variants.json").read_text())
    assert set(report["cases"]) == {"decode_float32", "decode_bfloat16", "prompt_float32", "prompt_bfloat16", "linears_float32_1rows"}
    for case in report["cases"].values():
        assert case["current"]["median_ms"] > 0 and case["current"]["median_over_current"] == 1.0

"""`python -m bench.experiments.decode_linears --quick` runs end to end on the demo model: the kernel gives
torch's lone-row bits on every layer, both engines produce the same tokens and free every block. No speed
is asserted."""

import json

import pytest

from bench.experiments import common, decode_linears
from engine import kernels
from tests.conftest import SUMS_AS_TORCH_BF16

BUILT = kernels.load()
pytestmark = pytest.mark.skipif(BUILT is None or not BUILT.one_row_linear_available() or not SUMS_AS_TORCH_BF16,
                                reason="the kernel needs a C++ toolchain and AVX512-BF16, and gives torch's lone rows only where "
                                       "torch does not pack for AMX tiles")


@pytest.fixture
def quick_results_in_tmp(monkeypatch, tmp_path):
    """--quick results go to tmp_path, not bench/results/quick: a test writes nothing under the repository."""
    monkeypatch.setattr(common, "use_quick_results", lambda: monkeypatch.setattr(common, "RESULTS", tmp_path))


def test_quick_run_writes_both_parts(quick_results_in_tmp):
    assert decode_linears.main(["--quick", "--threads", "1"]) == 0
    report = json.loads((common.RESULTS / "decode_linears.json").read_text())
    assert [r["rows"] for r in report["layers"]] == [1, 8]
    assert all(r["kernel_ms"] > 0 and r["torch_ms"] > 0 for r in report["layers"])
    engine = report["engine"]
    assert engine["outputs_identical"] and engine["output_tokens"] > 0
    assert set(engine["tokens_per_s"]) == {"kernel", "torch"} and min(engine["tokens_per_s"].values()) > 0

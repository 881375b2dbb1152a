"""engine.prompt_attention: whether whole prompts go to the C++ kernel or to SDPA, measured once per machine."""

from __future__ import annotations

import pytest
import torch

from engine import kernels, prompt_attention

pytestmark = pytest.mark.skipif(kernels.load() is None, reason="the C++ kernels do not build on this host (no compiler)")

GEOMETRY = dict(heads=9, kv_heads=3, head_dim=64, block_size=16)


@pytest.mark.parametrize(("kernel_s", "sdpa_s", "expected"), [(1.0, 2.0, True), (0.8, 1.0, True), (0.9, 1.0, False), (2.0, 1.0, False)])
def test_the_kernel_is_chosen_where_clearly_faster_and_kept_for_later_processes(monkeypatch, tmp_path, kernel_s, sdpa_s, expected):
    monkeypatch.setattr(kernels, "build_directory", lambda: tmp_path)
    measured = []
    monkeypatch.setattr(prompt_attention, "measure", lambda *args: measured.append(args) or (kernel_s, sdpa_s))
    assert prompt_attention.kernel_attends_prompts(torch.bfloat16, **GEOMETRY) is expected
    assert prompt_attention.kernel_attends_prompts(torch.bfloat16, **GEOMETRY) is expected
    assert len(measured) == 1, "measured again instead of read back"
    kept = kernels.read_measured(prompt_attention.CHOICES_FILE)
    assert kept == {prompt_attention.choice_key(torch.bfloat16, 9, 3, 64): {"kernel_s": kernel_s, "sdpa_s": sdpa_s}}
    prompt_attention.kernel_attends_prompts(torch.float32, **GEOMETRY)
    assert len(measured) == 2 and len(kernels.read_measured(prompt_attention.CHOICES_FILE)) == 2, "another dtype is measured on its own"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_real_measurement_times_both_paths(dtype):
    kernel_s, sdpa_s = prompt_attention.measure(dtype, **GEOMETRY)
    assert 0 < kernel_s < 1 and 0 < sdpa_s < 1

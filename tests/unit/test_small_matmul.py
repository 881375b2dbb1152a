"""The small-matmul kernel (engine.kernels) against torch's linear, and how engine.small_matmul installs it."""

import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from engine import kernels, small_matmul
from engine.small_matmul import FewRowsLinear

BUILT = kernels.load()
pytestmark = pytest.mark.skipif(BUILT is None, reason=f"no C++ toolchain here: {kernels.unavailable_reason()}")


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 17, 64, 70, 131])
@pytest.mark.parametrize("out_features,in_features", [(576, 576), (13, 100), (7, 37), (4, 8), (1, 1536)])
def test_matches_torch_linear(rows, out_features, in_features):
    """Row counts around the kernel's groups and its 64-row passes, weights with a partial last block of
    rows and dims past the last whole vector."""
    g = torch.Generator().manual_seed(rows * 1000 + out_features)
    x = torch.randn(rows, in_features, generator=g)
    weight = torch.randn(out_features, in_features, generator=g)
    bias = torch.randn(out_features, generator=g)
    expected = F.linear(x, weight, bias)
    got = BUILT.small_matmul(x, weight, bias)
    assert got.shape == expected.shape
    assert torch.allclose(got, expected, rtol=1e-5, atol=1e-5 * in_features**0.5)
    assert torch.allclose(BUILT.small_matmul(x, weight), F.linear(x, weight), rtol=1e-5, atol=1e-5 * in_features**0.5)


def test_keeps_leading_dims_and_reads_strided_rows():
    x = torch.randn(1, 6, 64).transpose(0, 1)  # [6, 1, 64], not contiguous
    weight = torch.randn(24, 64)
    got = BUILT.small_matmul(x, weight, None)
    assert got.shape == (6, 1, 24)
    assert torch.allclose(got, F.linear(x, weight), atol=1e-5)


def test_refuses_other_dtypes_with_a_reason():
    with pytest.raises(RuntimeError, match="float32"):
        BUILT.small_matmul(torch.randn(2, 8, dtype=torch.bfloat16), torch.randn(4, 8, dtype=torch.bfloat16), None)


class _Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(32, 64)
        self.down = nn.Linear(64, 32, bias=False)
        self.norm = nn.LayerNorm(32)

    def forward(self, x):
        return self.down(self.up(x))


def test_install_routes_few_rows_to_the_kernel(monkeypatch, tmp_path):
    monkeypatch.setattr(kernels, "build_directory", lambda: tmp_path)
    monkeypatch.setattr(small_matmul, "_best_times", lambda ours, theirs: (1.0, 2.0))  # the kernel "wins" at every count
    model = _Model()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    assert small_matmul.install(model) == max(small_matmul.CANDIDATE_ROWS)
    assert type(model.up) is FewRowsLinear and type(model.down) is FewRowsLinear and type(model.norm) is nn.LayerNorm
    assert model.state_dict().keys() == state.keys() and all(torch.equal(model.state_dict()[k], v) for k, v in state.items())
    calls = []
    monkeypatch.setattr(kernels.load(), "small_matmul", lambda *a: calls.append(a[0].shape) or F.linear(*a), raising=False)
    with torch.inference_mode():
        model(torch.randn(3, 32))
        model(torch.randn(1, 40, 32))  # 40 rows: more than the crossover
    assert calls == [(3, 32), (3, 64)]


def test_install_measures_once_per_machine_and_shape(monkeypatch, tmp_path):
    monkeypatch.setattr(kernels, "build_directory", lambda: tmp_path)
    timed = []

    def best_times(ours, theirs):
        timed.append(1)
        return (1.0, 2.0) if len(timed) <= 3 else (2.0, 1.0)  # wins up to 4 rows, loses beyond

    monkeypatch.setattr(small_matmul, "_best_times", best_times)
    assert small_matmul.install(_Model()) == 4
    measured = len(timed)
    assert small_matmul.install(_Model()) == 4 and len(timed) == measured  # read back, not measured again
    assert json.loads((tmp_path / small_matmul.CROSSOVERS_FILE).read_text()) == {f"64x32/{torch.get_num_threads()} threads": 4}


def test_a_kernel_that_never_wins_is_not_installed(monkeypatch, tmp_path):
    monkeypatch.setattr(kernels, "build_directory", lambda: tmp_path)
    monkeypatch.setattr(small_matmul, "_best_times", lambda ours, theirs: (2.0, 1.0))
    model = _Model()
    assert small_matmul.install(model) == 0
    assert type(model.up) is nn.Linear


def test_layers_cast_away_from_float32_go_back_to_torch(monkeypatch, tmp_path):
    monkeypatch.setattr(kernels, "build_directory", lambda: tmp_path)
    monkeypatch.setattr(small_matmul, "_best_times", lambda ours, theirs: (1.0, 2.0))
    model = _Model()
    small_matmul.install(model)
    model.to(torch.bfloat16)
    assert small_matmul.install(model) == 0
    assert type(model.up) is nn.Linear and type(model.down) is nn.Linear
    with torch.inference_mode():
        assert model(torch.randn(2, 32, dtype=torch.bfloat16)).dtype == torch.bfloat16

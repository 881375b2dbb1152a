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


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 17, 64, 70, 131])
@pytest.mark.parametrize("out_features,in_features", [(576, 576), (13, 100), (7, 37), (4, 8), (1, 1536)])
def test_matches_torch_linear(rows, out_features, in_features):
    """Row counts around the kernel's groups (an x of at most one group reads the next weight block ahead)
    and its 64-row passes, weights with a partial last block of rows and dims past the last whole vector."""
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


def _times(ours: float, theirs: float):
    """A stand-in for small_matmul._best_times: the same seconds for every shape."""
    def best_times(layers, count):
        keys = {small_matmul.shape_key(layer.weight) for layer in layers}
        return dict.fromkeys(keys, ours), dict.fromkeys(keys, theirs)
    return best_times


def test_install_routes_few_rows_to_the_kernel(monkeypatch, tmp_path):
    monkeypatch.setattr(kernels, "build_directory", lambda: tmp_path)
    monkeypatch.setattr(small_matmul, "_best_times", _times(1.0, 2.0))  # the kernel "wins" at every count
    model = _Model()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    threads = torch.get_num_threads()
    most = max(small_matmul.CANDIDATE_ROWS)
    assert small_matmul.install(model) == {f"64x32 float32/{threads} threads": most, f"32x64 float32/{threads} threads": most}
    assert type(model.up) is FewRowsLinear and type(model.down) is FewRowsLinear and type(model.norm) is nn.LayerNorm
    assert model.state_dict().keys() == state.keys() and all(torch.equal(model.state_dict()[k], v) for k, v in state.items())
    calls = []
    monkeypatch.setattr(kernels.load(), "small_matmul", lambda *a: calls.append(a[0].shape) or F.linear(*a), raising=False)
    with torch.inference_mode():
        model(torch.randn(3, 32))
        model(torch.randn(1, most + 6, 32))  # more rows than the crossover
    assert calls == [(3, 32), (3, 64)]


def test_install_measures_each_shape_once_per_machine(monkeypatch, tmp_path):
    monkeypatch.setattr(kernels, "build_directory", lambda: tmp_path)
    up, down = (small_matmul.shape_key(torch.empty(shape)) for shape in ((64, 32), (32, 64)))
    timed = []

    def best_times(layers, count):
        timed.append(count)
        assert [small_matmul.shape_key(layer.weight) for layer in layers] == [up, down]  # the model's order
        # the up projection: the kernel wins up to 4 rows; the down projection: up to 12, though it
        # loses at 8 (the counts up to 12 summed, it is still faster)
        ours = {up: 1.0 if count <= 4 else 2.0, down: {8: 3.0}.get(count, 1.0 if count <= 12 else 9.0)}
        return ours, dict.fromkeys(ours, 2.0)

    monkeypatch.setattr(small_matmul, "_best_times", best_times)
    assert small_matmul.install(_Model()) == {up: 4, down: 12}
    assert timed == list(small_matmul.CANDIDATE_ROWS)
    model = _Model()
    assert small_matmul.install(model) == {up: 4, down: 12} and timed == list(small_matmul.CANDIDATE_ROWS)  # read back, not measured again
    assert (model.up.few_rows, model.down.few_rows) == (4, 12)
    assert json.loads((tmp_path / small_matmul.CROSSOVERS_FILE).read_text()) == {up: 4, down: 12}


def test_measured_times_cover_every_shape_in_one_pass(monkeypatch):
    """The real timing: one entry per shape, positive, for both the kernel and torch."""
    model = _Model()
    layers = [model.up, model.down]
    ours, theirs = small_matmul._best_times(layers, 4)
    keys = {small_matmul.shape_key(layer.weight) for layer in layers}
    assert ours.keys() == theirs.keys() == keys
    assert all(v > 0 for v in (*ours.values(), *theirs.values()))


def test_a_kernel_that_never_wins_is_not_installed(monkeypatch, tmp_path):
    monkeypatch.setattr(kernels, "build_directory", lambda: tmp_path)
    monkeypatch.setattr(small_matmul, "_best_times", _times(2.0, 1.0))
    model = _Model()
    assert set(small_matmul.install(model).values()) == {0}
    assert type(model.up) is nn.Linear and type(model.down) is nn.Linear


def test_layers_cast_away_from_float32_go_back_to_torch(monkeypatch, tmp_path):
    monkeypatch.setattr(kernels, "build_directory", lambda: tmp_path)
    monkeypatch.setattr(small_matmul, "_best_times", _times(1.0, 2.0))
    model = _Model()
    small_matmul.install(model)
    model.to(torch.bfloat16)
    assert small_matmul.install(model) == {}
    assert type(model.up) is nn.Linear and type(model.down) is nn.Linear
    with torch.inference_mode():
        assert model(torch.randn(2, 32, dtype=torch.bfloat16)).dtype == torch.bfloat16

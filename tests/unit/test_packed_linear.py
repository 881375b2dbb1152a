"""engine.packed_linear: bf16 linear layers with their weight reordered once give F.linear's bits."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from engine import linears, one_row_linear, packed_linear

pytestmark = pytest.mark.skipif(not packed_linear.available(), reason="this CPU has no oneDNN bf16 (AVX512-BF16 or AMX): nothing is packed")


def _model(dtype=torch.bfloat16) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(96, 64, bias=False), nn.Linear(64, 96, bias=False)).to(dtype)


@torch.inference_mode()
def test_packed_layers_give_linears_bits_at_every_row_count():
    model = _model()
    assert packed_linear.install(model) == 2
    assert all(type(m) is packed_linear.PackedLinear for m in model)
    generator = torch.Generator().manual_seed(1)
    for rows in (1, 3, 32, 33, 64, 129, 2048):
        scales = 2.0 ** torch.randint(-8, 8, (1, rows, 96), generator=generator)
        x = (torch.randn(1, rows, 96, generator=generator) * scales).to(torch.bfloat16)
        hidden = model[0](x)
        assert hidden.shape == (1, rows, 64)
        assert torch.equal(hidden, F.linear(x, model[0].weight))
        assert torch.equal(model[1](hidden), F.linear(hidden, model[1].weight))


def test_install_again_keeps_the_packed_weight_and_leaves_other_layers():
    model = _model()
    packed_linear.install(model)
    first = model[0].packed
    assert packed_linear.install(model) == 2 and model[0].packed is first
    float_model, biased = _model(torch.float32), nn.Linear(8, 8).to(torch.bfloat16)
    assert packed_linear.install(float_model) == 0 and packed_linear.install(biased) == 0
    assert type(float_model[0]) is nn.Linear and type(biased) is nn.Linear


def test_a_shape_that_fails_the_probe_stays_with_torch(monkeypatch):
    monkeypatch.setattr(packed_linear, "gives_linears_bits", lambda weight, packed: weight.shape[0] != 64)
    model = _model()
    assert packed_linear.install(model) == 1
    assert type(model[0]) is nn.Linear and type(model[1]) is packed_linear.PackedLinear


def test_engine_linears_packs_what_the_lone_row_kernel_leaves():
    model = _model()
    linears.install(model)
    assert all(type(m) in (packed_linear.PackedLinear, one_row_linear.OneRowLinear) for m in model)
    assert sorted(model[0].state_dict()) == ["weight"]

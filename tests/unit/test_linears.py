"""engine.linears.align_parameters: parameters the loader left off a cache line move to memory of their own,
unchanged in value, tied ones still tied; an engine's float32 demo model has every parameter aligned."""

import torch
from torch import nn

from engine import linears
from tests.conftest import make_engine


def _unaligned(numel: int) -> torch.Tensor:
    """A view 8 bytes into a fresh buffer: where safetensors' file mapping puts a tensor."""
    return torch.randn(numel + 2)[2:]


def test_unaligned_parameters_move_and_tied_ones_stay_tied():
    embed, head = nn.Embedding(48, 16), nn.Linear(16, 48, bias=False)
    head.weight = embed.weight
    embed.weight.data = _unaligned(48 * 16).view(48, 16)
    norm = nn.LayerNorm(16)
    model = nn.ModuleDict({"embed": embed, "norm": norm, "head": head})
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    assert embed.weight.data_ptr() % linears.ALIGNMENT != 0

    assert linears.align_parameters(model) == 1
    assert all(p.data_ptr() % linears.ALIGNMENT == 0 for p in model.parameters())
    assert head.weight is embed.weight
    assert all(torch.equal(p, before[name]) for name, p in model.named_parameters())
    assert linears.align_parameters(model) == 0


def test_an_engines_float32_model_has_every_parameter_aligned(demo_model):
    engine = make_engine(demo_model, num_kv_blocks=16, max_model_len=128)
    params = list(engine.runner.model.parameters())
    assert params and all(p.data_ptr() % linears.ALIGNMENT == 0 for p in params)

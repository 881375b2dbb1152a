"""engine.one_row_linear: decode rows of bf16 linear layers summed as torch sums a row that comes alone."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from engine import kernels, one_row_linear
from engine.step import StepItem
from tests.conftest import SUMS_AS_TORCH_BF16

BUILT = kernels.load()
pytestmark = pytest.mark.skipif(BUILT is None or not BUILT.one_row_linear_available(), reason="the kernel needs a C++ toolchain and AVX512-BF16")


def _rows(m: int, k: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(m, k, generator=g) * 2.0 ** torch.randint(-8, 8, (m, k), generator=g)).to(torch.bfloat16)


@pytest.mark.skipif(not SUMS_AS_TORCH_BF16, reason="the kernel sums a lone row as torch does on AVX512-BF16 CPUs without AMX; with AMX "
                                                  "torch packs for its tiles (install() then leaves every layer to torch)")
@pytest.mark.parametrize("n,k", [(576, 1536), (576, 576), (64, 1100)])
@pytest.mark.parametrize("m", [1, 3, 8, 65])
def test_each_row_is_what_torch_gives_it_alone(n, k, m):
    weight = (torch.randn(n, k, generator=torch.Generator().manual_seed(1)) * 0.05).to(torch.bfloat16)
    x = _rows(m, k, seed=m)
    alone = torch.cat([F.linear(row[None], weight) for row in x])
    got = BUILT.one_row_linear(x, BUILT.pack_dim_pairs(weight))
    assert got.dtype == torch.bfloat16 and torch.equal(got, alone)


def test_lone_rows_are_the_decoding_requests_rows():
    rows = one_row_linear.LoneRows()
    prompt = StepItem(token_ids=[1, 2, 3], start=0, block_ids=[0], samples=True)
    decode = StepItem(token_ids=[4], start=9, block_ids=[1], samples=True)
    verify = StepItem(token_ids=[5, 6, 7], start=4, block_ids=[2], samples=True, num_proposed=2)
    rows.set([decode, prompt, verify])
    assert not rows.every and rows.index.tolist() == [0, 4, 5, 6]
    rows.set([decode, verify])
    assert rows.every and rows.index is None
    rows.set([prompt])
    assert not rows.every and rows.index is None


def test_install_takes_every_layer_the_kernel_reproduces_and_keeps_its_output():
    """A layer with K = 1536 sums a lone row differently here (the MLP's down projection); K = 576 does not.
    Both go through the kernel when every row decodes; in a step that also prefills, only the one that
    differs sends its decode rows there."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(1536, 576, bias=False), nn.Linear(576, 576, bias=False)).to(torch.bfloat16)
    x = _rows(6, 1536, seed=3)
    before = model[0](x)
    lone_rows = one_row_linear.install(model)
    if lone_rows is None and not SUMS_AS_TORCH_BF16:
        pytest.skip("with AMX torch packs for its tiles and sums lone rows in an order the kernel does not reproduce: install() leaves every layer to torch")
    assert lone_rows is not None and all(type(m) is one_row_linear.OneRowLinear for m in model)
    if not model[0].differs:
        pytest.skip("torch sums lone rows of a 576x1536 bf16 weight as it sums batches on this CPU, or the kernel does not reproduce them here")
    assert not model[1].differs
    prompt = StepItem(token_ids=[1, 2, 3, 4], start=0, block_ids=[0], samples=True)
    decodes = [StepItem(token_ids=[5], start=7, block_ids=[1], samples=True) for _ in range(2)]
    lone_rows.set([decodes[0], prompt, decodes[1]])
    mixed = model[0](x[None])[0]
    assert torch.equal(mixed[1:5], before[1:5])  # prompt rows: torch's batched sums
    for row in (0, 5):
        assert torch.equal(mixed[row], F.linear(x[row : row + 1], model[0].weight)[0])  # decode rows: each as if alone
    h = mixed.detach()
    assert torch.equal(model[1](h[None])[0], F.linear(h, model[1].weight))
    lone_rows.set([StepItem(token_ids=[5], start=7 + i, block_ids=[1], samples=True) for i in range(6)])
    assert torch.equal(model[1](h[None])[0], torch.cat([F.linear(row[None], model[1].weight) for row in h]))
    assert sorted(model[0].state_dict()) == sorted(model[1].state_dict()) == ["weight"]


def test_engines_sharing_a_model_share_its_lone_rows_and_each_sets_them_before_its_forward():
    """A second engine on the same loaded model installs again and gets the same LoneRows: whichever runner
    set it last decides the next forward, so engines stepping in turn each get their own rows."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(1536, 576, bias=False)).to(torch.bfloat16)
    first = one_row_linear.install(model)
    if first is None or not model[0].differs:
        pytest.skip("torch sums lone rows of a 576x1536 bf16 weight as it sums batches on this CPU, or the kernel does not reproduce them here")
    second = one_row_linear.install(model)
    assert second is first and model[0].lone_rows is first
    x = _rows(6, 1536, seed=4)
    first.set([StepItem(token_ids=[5], start=7 + i, block_ids=[1], samples=True) for i in range(6)])  # six decodes
    decoded = model[0](x[None])[0]
    second.set([StepItem(token_ids=[1, 2, 3, 4, 5, 6], start=0, block_ids=[0], samples=True)])  # a prompt
    prefilled = model[0](x[None])[0]
    assert torch.equal(prefilled, F.linear(x, model[0].weight))
    for row in range(6):
        assert torch.equal(decoded[row], F.linear(x[row : row + 1], model[0].weight)[0])
    assert not torch.equal(decoded, prefilled), "the probe found lone rows summed differently; these rows must show it"

"""The argmax kernel (engine.kernels' argmax_rows) against torch.argmax, and the sampler's greedy tokens through it."""

import pytest
import torch

from engine import kernels
from engine.sampler import greedy_tokens

BUILT = kernels.load()
pytestmark = pytest.mark.skipif(BUILT is None, reason=f"no C++ toolchain here: {kernels.unavailable_reason()}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,vocab", [(1, 49152), (7, 49152), (64, 1000), (3, 255), (2, 1), (5, 257)])
def test_matches_torch_argmax(dtype, rows, vocab):
    """Vocabularies of whole and partial scan blocks; bf16 rows, whose coarse values tie often."""
    g = torch.Generator().manual_seed(rows * vocab)
    logits = (torch.randn(rows, vocab, generator=g) * 4).to(dtype)
    assert torch.equal(BUILT.argmax_rows(logits), torch.argmax(logits, dim=-1))


def test_ties_take_the_first_index_and_odd_rows_are_handled():
    logits = torch.zeros(4, 600)
    logits[0, [5, 300, 599]] = 2.0  # a tie: the first wins
    logits[1] = float("-inf")  # all -inf: index 0, as torch
    logits[2, 599] = 1.0  # the maximum in the last, partial scan block
    logits[3, 10] = float("nan")  # a NaN before the maximum: the NaN, as torch
    logits[3, 20] = 7.0
    assert BUILT.argmax_rows(logits).tolist() == [5, 0, 599, 10] == torch.argmax(logits, dim=-1).tolist()
    strided = torch.randn(3, 400)[:, ::2]
    assert torch.equal(BUILT.argmax_rows(strided), torch.argmax(strided, dim=-1))


def test_refuses_what_it_cannot_read():
    with pytest.raises(RuntimeError, match="logits"):
        BUILT.argmax_rows(torch.zeros(2, 3, 4))
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        BUILT.argmax_rows(torch.zeros(2, 3, dtype=torch.float16))


def test_greedy_tokens_are_a_list_per_row():
    logits = torch.tensor([[0.0, 3.0, 1.0], [9.0, 1.0, 9.0]])
    assert greedy_tokens(logits) == [1, 0]

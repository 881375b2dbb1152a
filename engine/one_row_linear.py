"""bf16 linear layers whose decode rows sum as transformers' one-token decode sums them (CPU).

torch's bf16 linear sums an input row that comes alone in another order than a row among others when
the layer's inner size is large (engine/kernels/one_row_linear.cpp says how; on SmolLM2-135M only the
MLP's down projection, K = 1536). transformers' `generate` decodes one token at a time, so each of its
decode rows comes alone; the engine decodes many requests per step. With torch's linear its decode rows
would round differently from transformers' in about one output in a thousand, and a near tie between
two tokens downstream then flips greedy output (measured: 3 of the 8 demo prompts parted within 32
tokens in bf16). A layer where that happens sends the rows of decoding requests (one token, or a token
and the proposals it verifies) through the C++ kernel that sums each row as a lone row; prompt rows,
which transformers also computes many at a time, stay with torch.

Lifecycle: the ModelRunner calls `install(model)` once on a CPU (again for every engine built on the same
loaded model, which then shares the model's LoneRows). For every bf16 `nn.Linear` without a
bias it checks, on the layer's own weight with probe rows, that torch sums a lone row differently from
the same rows in a batch here, and that the kernel gives the lone rows bit for bit; such a layer becomes
a `OneRowLinear` holding its weight packed for the kernel (the module otherwise unchanged: parameters,
hooks, state dict). Every installed layer of a model shares one `LoneRows`, which a runner points at
its decoding rows right before each of its forwards (`LoneRows.set`), so engines sharing a model may step
in turn.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from engine import kernels
from engine.step import StepItem

log = logging.getLogger(__name__)

PROBE_ROWS = 32


class LoneRows:
    """Which rows of this step's packed input transformers would compute alone: the decoding requests'."""

    def __init__(self) -> None:
        self.every = False
        self.index: torch.Tensor | None = None
        """Packed row indices when some rows decode and others do not (None with `every` or no such row)."""

    def set(self, items: Sequence[StepItem]) -> None:
        """`items` in packed order; a request decodes when it computes one token or verifies proposals."""
        rows: list[int] = []
        first = 0
        for item in items:
            if item.num_tokens == 1 or item.num_proposed:
                rows.extend(range(first, first + item.num_tokens))
            first += item.num_tokens
        self.every = len(rows) == first
        self.index = torch.tensor(rows, dtype=torch.long) if rows and not self.every else None


class OneRowLinear(nn.Linear):
    packed: torch.Tensor
    lone_rows: LoneRows

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = self.lone_rows
        if rows.every:
            return kernels.load().one_row_linear(x, self.packed)
        out = F.linear(x, self.weight)
        if rows.index is not None:
            flat = out.view(-1, self.out_features)
            flat[rows.index] = kernels.load().one_row_linear(x.reshape(-1, self.in_features)[rows.index], self.packed)
        return out


def install(model: nn.Module) -> LoneRows | None:
    """Turn the model's bf16 CPU linear layers whose lone rows sum differently here into OneRowLinear;
    returns the LoneRows they share (None when no layer needs it or the kernel is not there)."""
    kernel = kernels.load()
    if kernel is None or not kernel.one_row_linear_available():
        return None
    lone_rows = next((m.lone_rows for m in model.modules() if type(m) is OneRowLinear), None) or LoneRows()
    verdicts: dict[tuple[int, int], bool] = {}
    for layer in [m for m in model.modules() if type(m) in (nn.Linear, OneRowLinear) and _eligible(m)]:
        packed = layer.packed if type(layer) is OneRowLinear else kernel.pack_dim_pairs(layer.weight.detach())
        layer.__class__ = nn.Linear
        shape = tuple(layer.weight.shape)
        if shape not in verdicts:
            verdicts[shape] = _needed(layer.weight.detach(), packed, kernel)
        if verdicts[shape]:
            layer.__class__ = OneRowLinear
            layer.packed = packed
            layer.lone_rows = lone_rows
    if not any(verdicts.values()):
        return None
    log.info("decode rows of bf16 linear layers %s sum as lone rows (engine.one_row_linear)", [s for s, v in verdicts.items() if v])
    return lone_rows


def _eligible(layer: nn.Linear) -> bool:
    w = layer.weight
    return layer.bias is None and w.dtype == torch.bfloat16 and w.device.type == "cpu" and w.shape[1] % 2 == 0 and w.shape[0] % 16 == 0


@torch.inference_mode()
def _needed(weight: torch.Tensor, packed: torch.Tensor, kernel) -> bool:
    """Whether torch sums lone rows of this weight differently from a batch of them here, and the kernel
    reproduces the lone rows (probe rows whose entries span many magnitudes, so that sums in different
    orders round differently)."""
    generator = torch.Generator().manual_seed(0)
    k = weight.shape[1]
    scales = 2.0 ** torch.randint(-8, 8, (PROBE_ROWS, k), generator=generator)
    x = (torch.randn(PROBE_ROWS, k, generator=generator) * scales).to(torch.bfloat16)
    alone = torch.cat([F.linear(row[None], weight) for row in x])
    if torch.equal(F.linear(x, weight), alone):
        return False
    if not torch.equal(kernel.one_row_linear(x, packed), alone):
        log.warning("torch sums lone rows of a %s bf16 linear in an order engine.one_row_linear does not reproduce "
                    "on this CPU: batched decode rows may round differently from transformers' one-token decode", tuple(weight.shape))
        return False
    return True

"""bf16 linear layers whose decode rows go through a C++ kernel that sums each as a lone row (CPU).

torch's bf16 linear sums an input row that comes alone in another order than a row among others when
the layer's inner size is large (engine/kernels/one_row_linear.cpp says how; on SmolLM2-135M only the
MLP's down projection, K = 1536). transformers' `generate` decodes one token at a time, so each of its
decode rows comes alone; the engine decodes many requests per step. With torch's linear its decode rows
would round differently from transformers' in about one output in a thousand, and a near tie between
two tokens downstream then flips greedy output (measured: 3 of the 8 demo prompts parted within 32
tokens in bf16). The kernel gives every row the lone row's sum, bit for bit, and reads the weight once
per eight rows from a copy packed for it, so it is also the fast way to a decode step's linear layers:
one pass over SmolLM2-135M's layers on an AMD EPYC (Zen 4) takes 8.6 ms for 1 row and 81 ms for 64,
torch's 33 and 106 ms (its GEMM reads the weight at a fraction of the memory's rate for few rows).

Lifecycle: the ModelRunner calls `install(model)` once on a CPU (again for every engine built on the same
loaded model, which then shares the model's LoneRows). For every bf16 `nn.Linear` without a bias it
checks, on the layer's own weight with probe rows, that the kernel gives torch's lone rows bit for bit
here, and whether torch sums the same rows in a batch differently (`differs`); such a layer becomes a
`OneRowLinear` holding its weight packed for the kernel (the module otherwise unchanged: parameters,
hooks, state dict; the packed copy costs as much memory again as the weight). Every installed layer of a
model shares one `LoneRows`, which a runner points at its decoding rows right before each of its
forwards (`LoneRows.set`), so engines sharing a model may step in turn. A step whose rows all decode (one
token, or a token and the proposals it verifies) runs an installed layer through the kernel if it
`differs`, or if the kernel beats torch's GEMM on that many rows here (measured once per machine, as
engine.small_matmul measures its kernel: on the EPYC above, at every count up to 64); in a step that
also prefills, prompt rows (which transformers also computes many at a time) take torch's GEMM, and only
a layer that `differs` sends its decode rows through the kernel as well.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from engine import host_memory, kernels, small_matmul
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

    def set_all(self, decoding: bool) -> None:
        """Every row decodes (True) or none does (False): for forwards that are not an engine's step."""
        self.every, self.index = decoding, None


class OneRowLinear(nn.Linear):
    packed: torch.Tensor
    lone_rows: LoneRows
    differs: bool
    """torch sums a row among others differently from the row alone here."""
    few_rows: int = 0
    """A layer that does not differ takes inputs of at most this many rows to the kernel (where it beats
    torch's GEMM here, engine.small_matmul.crossovers) and more to torch, which then gives the same bits."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = self.lone_rows
        if rows.every and (self.differs or x.numel() <= self.few_rows * self.in_features):
            return kernels.load().one_row_linear(x, self.packed)
        out = F.linear(x, self.weight)
        if self.differs and rows.index is not None:
            flat = out.view(-1, self.out_features)
            flat[rows.index] = kernels.load().one_row_linear(x.reshape(-1, self.in_features)[rows.index], self.packed)
        return out


def install(model: nn.Module) -> LoneRows | None:
    """Turn the model's bf16 CPU linear layers whose lone rows the kernel reproduces here into OneRowLinear;
    returns the LoneRows they share (None when no layer qualifies or the kernel is not there)."""
    kernel = kernels.load()
    if kernel is None or not kernel.one_row_linear_available():
        return None
    lone_rows = next((m.lone_rows for m in model.modules() if type(m) is OneRowLinear), None) or LoneRows()
    verdicts: dict[tuple[int, int], Verdict] = {}
    for layer in [m for m in model.modules() if type(m) in (nn.Linear, OneRowLinear) and _eligible(m)]:
        packed = layer.packed if type(layer) is OneRowLinear else host_memory.huge_copy(kernel.pack_dim_pairs(layer.weight.detach()))
        layer.__class__ = nn.Linear
        shape = tuple(layer.weight.shape)
        if shape not in verdicts:
            verdicts[shape] = verdict(layer.weight.detach(), packed, kernel)
        if verdicts[shape].reproduced:
            layer.__class__ = OneRowLinear
            layer.packed = packed
            layer.lone_rows = lone_rows
            layer.differs = verdicts[shape].differs
    if not any(v.reproduced for v in verdicts.values()):
        return None
    same = [m for m in model.modules() if type(m) is OneRowLinear and not m.differs]
    crossovers = small_matmul.crossovers(same) if same else {}
    for layer in same:
        layer.few_rows = crossovers[small_matmul.shape_key(layer.weight)]
    log.info("decode rows of bf16 linear layers go through engine.one_row_linear: %s",
             {shape: "lone rows sum differently from batched ones" if v.differs else "same sums" for shape, v in verdicts.items() if v.reproduced})
    return lone_rows


@dataclass(frozen=True)
class Verdict:
    reproduced: bool
    """The kernel gives torch's lone rows bit for bit."""
    differs: bool
    """torch sums the same rows in a batch differently."""


def _eligible(layer: nn.Linear) -> bool:
    w = layer.weight
    return layer.bias is None and w.dtype == torch.bfloat16 and w.device.type == "cpu" and w.shape[1] % 2 == 0 and w.shape[0] % 16 == 0


def probe_rows(rows: int, k: int, generator: torch.Generator) -> torch.Tensor:
    """bf16 rows whose entries span many magnitudes, so that sums in different orders round differently."""
    scales = 2.0 ** torch.randint(-8, 8, (rows, k), generator=generator)
    return (torch.randn(rows, k, generator=generator) * scales).to(torch.bfloat16)


@torch.inference_mode()
def verdict(weight: torch.Tensor, packed: torch.Tensor, kernel) -> Verdict:
    x = probe_rows(PROBE_ROWS, weight.shape[1], torch.Generator().manual_seed(0))
    alone = torch.cat([F.linear(row[None], weight) for row in x])
    differs = not torch.equal(F.linear(x, weight), alone)
    reproduced = torch.equal(kernel.one_row_linear(x, packed), alone)
    if differs and not reproduced:
        log.warning("torch sums lone rows of a %s bf16 linear in an order engine.one_row_linear does not reproduce "
                    "on this CPU: batched decode rows may round differently from transformers' one-token decode", tuple(weight.shape))
    return Verdict(reproduced, differs)

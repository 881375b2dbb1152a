"""Which CPU kernel each linear layer of a model runs through, decided once per model.

First the model's parameters move out of the checkpoint's file mapping where they sit there unaligned
(`align_parameters`: safetensors puts a tensor 8 bytes past a cache line, so every vector load of a
weight spans two lines; measured on an AMD EPYC, one pass over SmolLM2's float32 linear layers took
69-73 ms for 4 rows against 62-65 ms aligned, 245-249 against 229-244 ms for 64), the large ones onto
huge pages (engine.host_memory). The ModelRunner (and bench.ceilings, which must time the linear layers as the engine runs them) calls
`install(model)` on a CPU: float32 layers take the small-matmul kernel for inputs of few rows
(engine.small_matmul); bf16 layers whose lone rows the C++ kernel reproduces send decode rows there
(engine.one_row_linear); the bf16 layers left keep their weight reordered for oneDNN
(engine.packed_linear). Each of the three probes the layers' own weights and takes only those where it
gives torch's bits, and keeps what an earlier install on the same loaded model decided.
"""

from __future__ import annotations

import torch
from torch import nn

from engine import host_memory, one_row_linear, packed_linear, small_matmul

ALIGNMENT = 64
"""Bytes: a cache line, and the widest vector load (AVX-512)."""


def install(model: nn.Module) -> one_row_linear.LoneRows | None:
    """Returns the LoneRows a runner sets before each forward (None when no layer needs it)."""
    align_parameters(model)
    small_matmul.install(model)
    lone_rows = one_row_linear.install(model)
    packed_linear.install(model)
    return lone_rows


@torch.no_grad()
def align_parameters(model: nn.Module) -> int:
    """Copy each CPU parameter whose data does not start on a cache line, or (from 2 MiB up) on a huge page,
    into memory of its own from engine.host_memory (huge pages advised); tied parameters stay tied (they are one
    Parameter). Returns how many moved."""
    moved = 0
    for param in model.parameters():
        if param.device.type != "cpu" or type(param.data) is not torch.Tensor:
            continue
        large = param.numel() * param.element_size() >= host_memory.HUGE_PAGE
        if param.data_ptr() % (host_memory.HUGE_PAGE if large else ALIGNMENT):
            param.data = host_memory.huge_copy(param.data)
            moved += 1
    return moved

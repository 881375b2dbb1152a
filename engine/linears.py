"""Which CPU kernel each linear layer of a model runs through, decided once per model.

The ModelRunner (and bench.ceilings, which must time the linear layers as the engine runs them) calls
`install(model)` on a CPU: float32 layers take the small-matmul kernel for inputs of few rows
(engine.small_matmul); bf16 layers whose lone rows the C++ kernel reproduces send decode rows there
(engine.one_row_linear); the bf16 layers left keep their weight reordered for oneDNN
(engine.packed_linear). Each of the three probes the layers' own weights and takes only those where it
gives torch's bits, and keeps what an earlier install on the same loaded model decided.
"""

from __future__ import annotations

from torch import nn

from engine import one_row_linear, packed_linear, small_matmul


def install(model: nn.Module) -> one_row_linear.LoneRows | None:
    """Returns the LoneRows a runner sets before each forward (None when no layer needs it)."""
    small_matmul.install(model)
    lone_rows = one_row_linear.install(model)
    packed_linear.install(model)
    return lone_rows

"""bf16 linear layers whose weight oneDNN reorders once, at install, instead of on every call (CPU).

torch's bf16 linear on a CPU goes to oneDNN, which first reorders the weight into the blocked layout its
kernel reads (on a CPU with AMX, the tiles'), on every call: for the rows of a decode step that reorder
reads and writes the whole weight again and costs about as much as the product. oneDNN can keep the
weight reordered (`torch.ops.mkldnn._reorder_linear_weight`, what torch.compile's CPU freezing does), and
reordered for REORDER_FOR_ROWS rows its product gives F.linear's bits at every row count measured (1 to
2048). One pass over SmolLM2-135M's 211 linear layers, weights from memory, 1 thread, on an Intel Xeon with
AMX: 26 ms for 1 row, 31 for 32, 35 for 64, against F.linear's 39, 45 and 52 ms; the same at 2048 rows.

Lifecycle: the ModelRunner calls `install(model)` once on a CPU (engine.linears, after the kernels that
take bf16 layers first). Each bf16 `nn.Linear` left without a bias becomes a `PackedLinear` holding its
weight reordered (the module otherwise unchanged: parameters, hooks, state dict; the reordered copy costs
as much memory again as the weight), when for its shape the reordered product gives F.linear's bits here
on probe rows of every count in PROBE_ROW_COUNTS; a shape where it does not stays with F.linear. Layers
packed by an earlier install (another engine on the same loaded model) stay as they are.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from engine import one_row_linear

log = logging.getLogger(__name__)

REORDER_FOR_ROWS = 64
"""The row count the reorder is hinted for. Reordered for 1 row, oneDNN sums every row of an input of up
to 128 rows as it sums a row alone, and so unlike F.linear beyond 32 rows (measured with AMX)."""
PROBE_ROW_COUNTS = (1, 2, 5, 16, 31, 32, 33, 48, 64, 65, 100, 256, 777)


class PackedLinear(nn.Linear):
    packed: torch.Tensor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _product(x, self.packed, self.out_features)


def install(model: nn.Module) -> int:
    """Turn the model's bf16 CPU `nn.Linear` layers whose shape passes the probe into PackedLinear; returns
    how many of its layers are packed (those of an earlier install included)."""
    if not available():
        return 0
    verdicts: dict[tuple[int, int], bool] = {}
    for layer in [m for m in model.modules() if type(m) is nn.Linear and _eligible(m)]:
        weight = layer.weight.detach()
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, REORDER_FOR_ROWS)
        shape = tuple(weight.shape)
        if shape not in verdicts:
            verdicts[shape] = gives_linears_bits(weight, packed)
        if verdicts[shape]:
            layer.__class__ = PackedLinear
            layer.packed = packed
    if verdicts:
        log.info("bf16 linear layers with their weight reordered once (engine.packed_linear), per shape: %s", verdicts)
    return sum(1 for m in model.modules() if type(m) is PackedLinear)


def available() -> bool:
    """oneDNN with bf16 on this CPU, and this torch's ops for weights reordered once (internal to torch)."""
    ops = torch.ops.mkldnn
    try:
        return torch.backends.mkldnn.is_available() and ops._is_mkldnn_bf16_supported() and bool(ops._reorder_linear_weight and ops._linear_pointwise)
    except (AttributeError, RuntimeError):
        return False


@torch.inference_mode()
def gives_linears_bits(weight: torch.Tensor, packed: torch.Tensor) -> bool:
    """On engine.one_row_linear's probe rows, PROBE_ROW_COUNTS of them in turn."""
    generator = torch.Generator().manual_seed(0)
    for rows in PROBE_ROW_COUNTS:
        x = one_row_linear.probe_rows(rows, weight.shape[1], generator)
        if not torch.equal(_product(x, packed, weight.shape[0]), F.linear(x, weight)):
            return False
    return True


def _product(x: torch.Tensor, packed: torch.Tensor, out_features: int) -> torch.Tensor:
    flat = x.reshape(-1, x.shape[-1])
    out = torch.ops.mkldnn._linear_pointwise(flat, packed, None, "none", [], "")
    return out.view(*x.shape[:-1], out_features)


def _eligible(layer: nn.Linear) -> bool:
    w = layer.weight
    return layer.bias is None and w.dtype == torch.bfloat16 and w.device.type == "cpu" and type(w.data) is torch.Tensor  # not a DTensor shard

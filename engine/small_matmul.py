"""Linear layers on inputs of few rows through the C++ small-matmul kernel, where it beats torch's GEMM.

A decode step of a small batch, or requests verifying a few proposed tokens, hands every linear layer
an input of a few rows. Such a layer is bound by reading its weight, which torch's GEMM does at a
fraction of the memory's rate on some CPUs (measured on an AMD EPYC with AVX2: 2 to 8 rows cost 1.3 to
1.8x what engine.kernels' `small_matmul` costs, which reads each weight row once for all rows).

Lifecycle: the ModelRunner calls `install(model)` once, on a CPU. For each weight shape of the model's
float32 linear layers it measures up to how many rows the kernel beats `torch.nn.functional.linear` on
this machine (`crossovers`: 0 where it never does; nothing when the kernels are not built), timing the
layers in the model's order so that every weight comes from memory as in a forward (a small layer whose
weight sits in cache favours torch's GEMM, one read from memory favours the kernel: on an AMD EPYC with
AVX2 the 576x576 projections crossed over at ~12 rows, the 49152x576 LM head at ~32; on a Zen 4 EPYC, one
thread, at 32 and 64 rows). It then turns each such
`nn.Linear` into a `FewRowsLinear` (the same module: parameters, hooks and state dict unchanged) that
sends inputs of at most its shape's crossover rows to the kernel and the rest to torch. `crossovers` also
decides, the same way, how many rows engine.one_row_linear's bf16 layers take to their kernel (`_kernel`
picks the kernel by the layer).
"""

from __future__ import annotations

import logging
import time

import torch
import torch.nn.functional as F
from torch import nn

from engine import kernels

log = logging.getLogger(__name__)

CANDIDATE_ROWS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64)
ROUNDS = 2

CROSSOVERS_FILE = "small_matmul_crossovers.json"
"""Next to the kernels' build (engine.kernels.build_directory()): measured once per machine, weight shape
and thread count, and read by every later process."""


class FewRowsLinear(nn.Linear):
    few_rows: int = 0
    """Inputs of at most this many rows go through the small-matmul kernel."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.numel() <= self.few_rows * self.in_features:
            return kernels.load().small_matmul(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)


def install(model: nn.Module) -> dict[str, int]:
    """Turn the model's float32 CPU linear layers into FewRowsLinear with their shape's measured crossover
    (and any FewRowsLinear the kernel cannot take, after a cast, back into nn.Linear); returns the
    crossover per shape key (empty when no layer can use the kernel)."""
    linears = [m for m in model.modules() if type(m) in (nn.Linear, FewRowsLinear)]
    layers = [m for m in linears if _eligible(m.weight)]
    for layer in linears:
        layer.__class__ = nn.Linear
    if not layers or kernels.load() is None:
        return {}
    rows = crossovers(layers)
    for layer in layers:
        layer.few_rows = rows[shape_key(layer.weight)]
        if layer.few_rows:
            layer.__class__ = FewRowsLinear
    log.info("linear layers use the small-matmul kernel up to these rows: %s", rows)
    return rows


def shape_key(weight: torch.Tensor) -> str:
    return f"{weight.shape[0]}x{weight.shape[1]} {str(weight.dtype).removeprefix('torch.')}/{torch.get_num_threads()} threads"


def _eligible(w: torch.Tensor) -> bool:
    return w.dtype == torch.float32 and w.device.type == "cpu" and w.is_contiguous() and type(w.data) is torch.Tensor


def crossovers(layers: list[nn.Linear]) -> dict[str, int]:
    """Per weight shape of `layers` (in the model's order), the most rows up to which its kernel (`_kernel`) beats
    torch here: the largest of CANDIDATE_ROWS where it is faster and, summed over the counts up to it, not
    slower. Shapes this machine has not measured yet are measured now and kept (CROSSOVERS_FILE)."""
    keys = {shape_key(layer.weight) for layer in layers}
    known = kernels.read_measured(CROSSOVERS_FILE)
    missing = keys - known.keys()
    if missing:
        measured = _measure([layer for layer in layers if shape_key(layer.weight) in missing])
        known = {**kernels.read_measured(CROSSOVERS_FILE), **measured}
        kernels.keep_measured(CROSSOVERS_FILE, known)
    return {key: known[key] for key in sorted(keys)}


def _measure(layers: list[nn.Linear]) -> dict[str, int]:
    rows = {shape_key(layer.weight): 0 for layer in layers}
    totals = {key: [0.0, 0.0] for key in rows}
    for count in CANDIDATE_ROWS:
        ours, theirs = _best_times(layers, count)
        for key, total in totals.items():
            total[0] += ours[key]
            total[1] += theirs[key]
            if ours[key] < theirs[key] and total[0] <= total[1]:
                rows[key] = count
    return rows


@torch.inference_mode()
def _best_times(layers: list[nn.Linear], count: int) -> tuple[dict[str, float], dict[str, float]]:
    """Seconds per shape key for one pass over `layers` on `count` rows: the kernel's and torch's, passes
    alternating, each shape's best of ROUNDS (one slow sample on a shared machine does not decide)."""
    inputs = {(layer.in_features, layer.weight.dtype): torch.randn(count, layer.in_features).to(layer.weight.dtype) for layer in layers}
    calls = (lambda layer: _kernel(layer, inputs[layer.in_features, layer.weight.dtype]),
             lambda layer: F.linear(inputs[layer.in_features, layer.weight.dtype], layer.weight))
    best = [{shape_key(layer.weight): float("inf") for layer in layers} for _ in calls]
    for _ in range(ROUNDS):
        for call, times in zip(calls, best):
            spent: dict[str, float] = dict.fromkeys(times, 0.0)
            for layer in layers:
                started = time.perf_counter()
                call(layer)
                spent[shape_key(layer.weight)] += time.perf_counter() - started
            for key, seconds in spent.items():
                times[key] = min(times[key], seconds)
    return best[0], best[1]


def _kernel(layer: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """The kernel the layer would send few rows to: engine.one_row_linear's for a layer holding its weight
    packed for it (bf16), else the small-matmul kernel."""
    packed = getattr(layer, "packed", None)
    if packed is not None:
        return kernels.load().one_row_linear(x, packed)
    return kernels.load().small_matmul(x, layer.weight, None)

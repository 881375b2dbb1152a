"""Linear layers on inputs of few rows through the C++ small-matmul kernel, where it beats torch's GEMM.

A decode step of a small batch, or requests verifying a few proposed tokens, hands every linear layer
an input of a few rows. Such a layer is bound by reading its weight, which torch's GEMM does at a
fraction of the memory's rate on some CPUs (measured on an AMD EPYC with AVX2: 2 to 8 rows cost 1.3 to
1.8x what engine.kernels' `small_matmul` costs, which reads each weight row once for all rows).

Lifecycle: the ModelRunner calls `install(model)` once, on a CPU. It measures on the model's largest
float32 linear layer up to how many rows the kernel beats `torch.nn.functional.linear` on this machine
(`crossover_rows`: 0 when it never does, or when the kernels are not built), then turns each float32
`nn.Linear` into a `FewRowsLinear` (the same module: parameters, hooks and state dict unchanged) that
sends inputs of at most that many rows to the kernel and the rest to torch.
"""

from __future__ import annotations

import json
import logging
import os
import time

import torch
import torch.nn.functional as F
from torch import nn

from engine import kernels

log = logging.getLogger(__name__)

CANDIDATE_ROWS = (1, 2, 4, 8, 16, 32)
ROUNDS = 3

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


def install(model: nn.Module) -> int:
    """Turn the model's float32 CPU linear layers into FewRowsLinear with the measured crossover (and any
    FewRowsLinear the kernel cannot take, after a cast, back into nn.Linear); returns the crossover."""
    linears = [m for m in model.modules() if type(m) in (nn.Linear, FewRowsLinear)]
    layers = [m for m in linears if _eligible(m.weight)]
    for layer in linears:
        layer.__class__ = nn.Linear
    if not layers or kernels.load() is None:
        return 0
    largest = max(layers, key=lambda m: m.weight.numel())
    rows = crossover_rows(largest.weight)
    if rows:
        for layer in layers:
            layer.__class__ = FewRowsLinear
            layer.few_rows = rows
    log.info("linear layers on at most %d rows use the small-matmul kernel (measured on a %s weight)", rows, tuple(largest.weight.shape))
    return rows


def _eligible(w: torch.Tensor) -> bool:
    return w.dtype == torch.float32 and w.device.type == "cpu" and w.is_contiguous() and type(w.data) is torch.Tensor


@torch.inference_mode()
def crossover_rows(weight: torch.Tensor) -> int:
    """The most rows up to which the kernel beats torch on `weight` here: the largest of CANDIDATE_ROWS
    where it is faster and, summed over the counts up to it, not slower (both timed alternately, best of
    ROUNDS, so one slow sample on a shared machine does not decide). Measured once per weight shape and
    thread count on a machine (CROSSOVERS_FILE)."""
    path = kernels.build_directory() / CROSSOVERS_FILE
    known = _read(path)
    key = f"{weight.shape[0]}x{weight.shape[1]}/{torch.get_num_threads()} threads"
    if key not in known:
        kernel, rows, ours_total, theirs_total = kernels.load(), 0, 0.0, 0.0
        for count in CANDIDATE_ROWS:
            x = torch.randn(count, weight.shape[1])
            ours, theirs = _best_times(lambda x=x: kernel.small_matmul(x, weight, None), lambda x=x: F.linear(x, weight))
            ours_total, theirs_total = ours_total + ours, theirs_total + theirs
            if ours < theirs and ours_total <= theirs_total:
                rows = count
        known = {**_read(path), key: rows}
        _write(path, known)
    return known[key]


def _read(path) -> dict[str, int]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _write(path, known: dict[str, int]) -> None:
    try:
        staged = path.with_name(f"{path.name}.{os.getpid()}")
        staged.write_text(json.dumps(known, indent=1, sort_keys=True) + "\n")
        os.replace(staged, path)  # atomic: a process reading meanwhile never sees half a file
    except OSError as exc:  # a read-only cache: measured again by the next process
        log.warning("could not keep the measured crossover in %s: %s", path, exc)


def _best_times(first, second) -> tuple[float, float]:
    best = [float("inf"), float("inf")]
    for _ in range(ROUNDS):
        for i, call in enumerate((first, second)):
            started = time.perf_counter()
            call()
            best[i] = min(best[i], time.perf_counter() - started)
    return best[0], best[1]

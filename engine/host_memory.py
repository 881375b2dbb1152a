"""Large CPU tensors on transparent huge pages: the KV pool and the model's weights.

A decode step streams every weight and every live request's K/V from memory. On 4 KiB pages that is a
TLB miss every 4 KiB; on 2 MiB pages, one per 2 MiB. Linux backs anonymous memory with huge pages
where it is asked to (`madvise(MADV_HUGEPAGE)`; /sys/kernel/mm/transparent_hugepage/enabled says
`madvise` on most distributions, `always` on some), and only for pages not yet touched, so the advice
comes between the allocation and the first write. `empty()` does that; the KV pool (engine.kv_cache)
and the weights (engine.linears' `align_parameters`) are allocated through it. Where the advice is
not available (not Linux, THP disabled) the tensor is an ordinary one.

Measured on an AMD EPYC (Zen 4), one thread, float32: one pass over SmolLM2-135M's linear layers for
4 rows 22.8-23.7 -> 21.6-22.5 ms, for 8 rows 37.9-38.8 -> 36.6-37.6 ms; decode attention at batch 64
61.3 -> 56.3 ms per step (bf16 44.0 -> 43.0).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import math
import sys

import torch

HUGE_PAGE = 2 << 20
MADV_HUGEPAGE = 14


@functools.cache
def _madvise():
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None
    madvise = libc.madvise
    madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    madvise.restype = ctypes.c_int
    return madvise


def empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised contiguous CPU tensor; from 2 MiB up it starts on a huge-page boundary and its
    pages are advised to be huge. The tensor is a view of a slightly larger buffer, which it keeps alive."""
    nbytes = math.prod(shape) * dtype.itemsize
    madvise = _madvise()
    if nbytes < HUGE_PAGE or madvise is None:
        return torch.empty(shape, dtype=dtype)
    raw = torch.empty(nbytes + HUGE_PAGE, dtype=torch.uint8)
    start = -raw.data_ptr() % HUGE_PAGE
    madvise(raw.data_ptr() + start, nbytes, MADV_HUGEPAGE)  # best effort: the tensor is the same either way
    return raw[start:start + nbytes].view(dtype).view(shape)


def zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return empty(shape, dtype).zero_()


def huge_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of a CPU tensor in memory from `empty()`."""
    return empty(tuple(tensor.shape), tensor.dtype).copy_(tensor)

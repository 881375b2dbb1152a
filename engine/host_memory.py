"""Large CPU tensors on transparent huge pages: the KV pool and the model's weights.

A decode step streams every weight and every live request's K/V from memory. On 4 KiB pages that is a
TLB miss every 4 KiB; on 2 MiB pages, one per 2 MiB. Linux backs anonymous memory with huge pages
where it is asked to (`madvise(MADV_HUGEPAGE)`; /sys/kernel/mm/transparent_hugepage/enabled says
`madvise` on most distributions, `always` on some), and only for pages not yet touched, so the advice
comes between the mapping and the first write. `empty()` does that; the KV pool (engine.kv_cache),
the weights (engine.linears' `align_parameters`) and the packed bf16 lone-row weights
(engine.one_row_linear) are allocated through it. Where the advice is not available (not Linux, THP
disabled) the pages are ordinary ones.

Measured on an AMD EPYC (Zen 4), one thread, float32: one pass over SmolLM2-135M's linear layers for
4 rows 22.8-23.7 -> 21.6-22.5 ms, for 8 rows 37.9-38.8 -> 36.6-37.6 ms; decode attention at batch 64
61.3 -> 56.3 ms per step (bf16 44.0 -> 43.0).

The tensors a step makes and frees (activations, logits: a few MB each) are another matter: glibc's malloc
gives an allocation that large a fresh mapping of its own, or trims the heap under it when it is freed, so
every step faulted its activations in again, page by page, each page zeroed by the kernel (143,000 faults
and 0.22 s of system time in a 2.4 s bf16 prefill step of 2048 tokens). `keep_freed_memory()` tells malloc
to keep what is freed for the next step, as the caching allocator does on a GPU; engine.model_runner's
`install_kernels` calls it on a CPU, once per process. Measured on that EPYC (the engine stepping in a thread
of its own, as in a worker; bf16, 1 thread): 7 prompts of 292 tokens 2.34 -> 2.23 s, 32 requests' decode
steps 13.5 -> 12.3 s; float32 3-4 % less.
"""

from __future__ import annotations

import ctypes
import math
import mmap
import platform
from functools import cache

import torch

HUGE_PAGE = 2 << 20

KEPT_ALLOCATION_BYTES = 256 << 20
"""Allocations below this come from malloc's heap and are reused after they are freed; 256 MiB holds a 2048-token
step's activations of an 8B model in float32 (a larger one, such as a whole prompt's logits, is mapped as before)."""
KEPT_FREE_BYTES = 512 << 20
"""Free memory at the top of the heap that malloc keeps instead of giving it back to the kernel."""
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_ARENA_MAX = -1, -3, -8  # malloc.h


def empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised contiguous CPU tensor; from 2 MiB up it lies in a fresh anonymous mapping of its own,
    starts on a huge-page boundary and its pages are advised to be huge. Its own mapping, not the allocator's:
    in a long-lived process malloc may hand out heap memory whose pages were touched already (4 KiB pages for
    good). The tensor is a view of the mapping, which it keeps alive; freeing the tensor unmaps it."""
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes < HUGE_PAGE or not hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.empty(shape, dtype=dtype)
    region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # shared memory is shmem's THP setting
    try:
        region.madvise(mmap.MADV_HUGEPAGE)
    except OSError:  # THP not built into this kernel: ordinary pages, the same tensor
        pass
    raw = torch.frombuffer(region, dtype=torch.uint8)
    start = -raw.data_ptr() % HUGE_PAGE
    return raw[start:start + nbytes].view(dtype).view(shape)


def zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return empty(shape, dtype).zero_()


def huge_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of a CPU tensor in memory from `empty()`."""
    return empty(tuple(tensor.shape), tensor.dtype).copy_(tensor)


@cache
def keep_freed_memory() -> bool:
    """Set glibc's malloc, for the whole process, to serve allocations below KEPT_ALLOCATION_BYTES from its heap,
    to keep up to KEPT_FREE_BYTES of free heap, and to use that one heap from every thread (an engine steps in
    a thread of its own in a worker: engine.async_engine; per-thread heaps are at most 64 MiB and give memory
    back on their own terms). So a step's tensors land in pages the previous step touched. The process's
    resident memory then stays near its peak. Returns False where the C library is not glibc (nothing changed)."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    libc = ctypes.CDLL(None)
    return all(libc.mallopt(option, value) == 1 for option, value in (
        (_M_MMAP_THRESHOLD, KEPT_ALLOCATION_BYTES), (_M_TRIM_THRESHOLD, KEPT_FREE_BYTES), (_M_ARENA_MAX, 1)))

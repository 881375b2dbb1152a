"""Payload checksums: which algorithms this process can compute, and picking one per transfer.

Lifecycle: a receiver lists what it supports in its HELLO; the sender picks the first of its
own preferences the receiver also supports and announces it in the transfer's BEGIN header;
both sides then checksum every layer with it. Preference: `crc32c` when the `crc32c` package
runs it in hardware (SSE4.2/ARMv8 CRC instructions, ~25 GB/s/core here), else zlib's `crc32`
(~2-4 GB/s/core here), which is always available. Both are CRC-32s (Castagnoli / IEEE), so
they catch every burst error up to 32 bits; both release the GIL on large buffers.
"""

from __future__ import annotations

import asyncio
import zlib
from collections.abc import Callable, Iterable, Sequence
from typing import Any

Checksum = Callable[[Any, int], int]

_ALGORITHMS: dict[str, Checksum] = {"crc32": zlib.crc32}
try:
    import crc32c as _crc32c

    _ALGORITHMS["crc32c"] = _crc32c.crc32c
    _CRC32C_FAST = bool(getattr(_crc32c, "hardware_based", False))
except ImportError:  # optional dependency; zlib.crc32 is the fallback
    _CRC32C_FAST = False

DEFAULT = "crc32"

# Checksums of payloads at least this large run in a worker thread (they release the GIL).
_THREAD_BYTES = 256 << 10


def supported() -> tuple[str, ...]:
    """Algorithms this process can compute, fastest first."""
    if "crc32c" in _ALGORITHMS and _CRC32C_FAST:
        return ("crc32c", "crc32")
    return tuple(sorted(_ALGORITHMS, key=lambda name: name != "crc32"))


def choose(peer_supports: Iterable[str], preferences: Sequence[str] | None = None) -> str:
    """First of our preferences (default: `supported()`) that the peer can verify."""
    theirs = set(peer_supports)
    for name in preferences or supported():
        if name in theirs and name in _ALGORITHMS:
            return name
    return DEFAULT


def compute(algorithm: str, buffers: Iterable[Any], value: int = 0) -> int:
    """Checksum of the concatenation of `buffers` (anything exposing the buffer protocol)."""
    fn = _ALGORITHMS[algorithm]
    for buf in buffers:
        value = fn(buf, value)
    return value


async def compute_off_loop(algorithm: str, buffers: Sequence[Any], nbytes: int) -> int:
    """`compute` from an event loop: in a worker thread when the `nbytes` to checksum are many."""
    if nbytes >= _THREAD_BYTES:
        return await asyncio.to_thread(compute, algorithm, buffers)
    return compute(algorithm, buffers)


def is_supported(algorithm: str) -> bool:
    return algorithm in _ALGORITHMS

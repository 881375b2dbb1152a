"""Lossy KV compression on the wire: what a layer's K or V looks like between sender and receiver.

Lifecycle: the sender's `WirePolicy` picks the wire dtype of each transfer when it starts
(`TransferHeader.wire_dtype`): the configured one, or with `auto` int8 only while the link rate
measured from earlier transfers to that receiver is below `compress_below_gbps`. The sender
encodes each layer part with `encode` and checksums the encoded bytes (the checksum covers what
is on the wire). The receiver wraps its `PoolTarget` with `target_for(header, target)`: for a
compressed transfer the payload lands in staging buffers, is checked, then `commit` decodes it
into the pool's native dtype. Native transfers are untouched (zero copy as before).

Encoding of one part (K or V of one layer, `rows = tokens x kv_heads` rows of `head_dim`):
`rows` float32 scales (absmax of the row / the code's max), then `rows x head_dim` codes
(int8: round(x / scale); fp8: float8_e4m3fn of x / scale). One scale per token and head keeps
an outlier in one head from flattening the others.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np
import torch

from kvtransfer.buffers import PoolTarget, tensor_bytes
from kvtransfer.errors import ProtocolError

WIRE_DTYPES = ("auto", "native", "int8", "fp8")
_CODES = {"int8": (torch.int8, 127.0), "fp8": (torch.float8_e4m3fn, 448.0)}
_SCALE_BYTES = 4


def check_wire_dtype(name: str) -> None:
    if name != "native" and name not in _CODES:
        raise ProtocolError(f"wire dtype {name!r} is not supported here (native, {', '.join(_CODES)})")


def part_nbytes(num_tokens: int, num_kv_heads: int, head_dim: int, native_elem: int, wire_dtype: str) -> int:
    """Bytes of one encoded part (K or V of one layer)."""
    rows = num_tokens * num_kv_heads
    if wire_dtype == "native":
        return rows * head_dim * native_elem
    return rows * (_SCALE_BYTES + head_dim)


def encode(t: torch.Tensor, head_dim: int, wire_dtype: str) -> np.ndarray:
    """The wire bytes of one part (flat uint8): native bytes, or scales followed by codes."""
    if wire_dtype == "native":
        return tensor_bytes(t)
    code, code_max = _CODES[wire_dtype]
    rows = t.detach().reshape(-1, head_dim).float()
    scales = rows.abs().amax(dim=1).clamp_min(1e-12) / code_max
    scaled = rows / scales[:, None]
    codes = scaled.round_().to(code) if code is torch.int8 else scaled.to(code)
    return np.concatenate([tensor_bytes(scales), tensor_bytes(codes)])


def decode(buf: np.ndarray, num_rows: int, head_dim: int, wire_dtype: str, dtype: torch.dtype) -> torch.Tensor:
    """[num_rows, head_dim] in `dtype` from the bytes `encode` made."""
    code, _ = _CODES[wire_dtype]
    raw = torch.from_numpy(buf)
    scales = raw[: num_rows * _SCALE_BYTES].view(torch.float32)
    codes = raw[num_rows * _SCALE_BYTES :].view(code).reshape(num_rows, head_dim)
    return (codes.float() * scales[:, None]).to(dtype)


def encode_parts(k: torch.Tensor, v: torch.Tensor, head_dim: int, wire_dtype: str) -> list[np.ndarray]:
    return [encode(k, head_dim, wire_dtype), encode(v, head_dim, wire_dtype)]


class WireTarget:
    """A `PoolTarget` seen through a codec: byte views are staging buffers of the encoded parts;
    `commit(layer)` decodes a verified layer into the pool."""

    def __init__(self, target: PoolTarget, wire_dtype: str):
        layout = target.cache.layout
        self.target, self.wire_dtype = target, wire_dtype
        self.rows = target.num_tokens * target.num_heads
        self.head_dim = layout.head_dim
        self.part_nbytes = part_nbytes(target.num_tokens, target.num_heads, layout.head_dim, 0, wire_dtype)
        self._staging: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    def views(self, layer: int, part: int) -> list[memoryview]:
        staged = self._staging.setdefault(layer, (np.empty(self.part_nbytes, np.uint8), np.empty(self.part_nbytes, np.uint8)))
        return [memoryview(staged[part])]

    def commit(self, layer: int) -> None:
        staged = self._staging.pop(layer, None)
        if staged is None:
            return
        cache = self.target.cache
        shape = (self.target.num_tokens, self.target.num_heads, self.head_dim)
        k, v = (decode(staged[p], self.rows, self.head_dim, self.wire_dtype, cache.layout.dtype).reshape(shape) for p in (0, 1))
        device = cache.key_caches[layer].device
        cache.write_tokens(layer, self.target.block_ids, k.to(device), v.to(device), self.target.first_head)

    def release(self) -> None:
        self._staging.clear()
        self.target.release()


def target_for(target: PoolTarget, wire_dtype: str) -> PoolTarget | WireTarget:
    check_wire_dtype(wire_dtype)
    return target if wire_dtype == "native" else WireTarget(target, wire_dtype)


@dataclass
class _Link:
    bytes: float = 0.0
    seconds: float = 0.0


@dataclass
class WirePolicy:
    """Chooses each transfer's wire dtype; with `auto`, from the link rate measured per receiver.

    The rate of a receiver is bytes on the wire over the time the sender spent blocked on the
    network for them (sending layers, and from the trailer to the receiver's answer), summed
    over its last transfers with older ones decaying; the time it waited for the model to
    compute the next layer is not counted, so layer-wise streaming does not look like a slow link."""

    wire_dtype: str = "native"
    compress_below_gbps: float = 2.0
    compressed: str = "int8"
    decay: float = 0.5
    min_sample_bytes: int = 4 << 20
    """Smaller transfers are not measured: their time is mostly round trips, not bytes."""
    _links: dict[str, _Link] = field(default_factory=dict)

    def choose(self, receiver: str) -> str:
        if self.wire_dtype != "auto":
            return self.wire_dtype
        gbps = self.gbps(receiver)
        return self.compressed if gbps is not None and gbps < self.compress_below_gbps else "native"

    def gbps(self, receiver: str) -> float | None:
        link = self._links.get(receiver)
        return None if link is None or link.seconds <= 0 else link.bytes * 8 / link.seconds / 1e9

    def record(self, receiver: str, nbytes: int, busy_s: float) -> None:
        if nbytes < self.min_sample_bytes:
            return
        link = self._links.setdefault(receiver, _Link())
        link.bytes = link.bytes * self.decay + nbytes
        link.seconds = link.seconds * self.decay + busy_s


def roundtrip_error(parts: Iterable[torch.Tensor], head_dim: int, wire_dtype: str) -> float:
    """Largest relative error (to each row's absmax) of encode+decode over `parts` (for docs and tests)."""
    worst = 0.0
    for t in parts:
        rows = t.reshape(-1, head_dim).float()
        back = decode(encode(t, head_dim, wire_dtype), rows.shape[0], head_dim, wire_dtype, torch.float32)
        scale = rows.abs().amax(dim=1, keepdim=True).clamp_min(1e-12)
        worst = max(worst, float(((back - rows).abs() / scale).max()))
    return worst

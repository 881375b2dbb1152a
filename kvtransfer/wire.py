"""KV transfer wire format: framing, message bodies, model fingerprint and checksums.

Pure functions and dataclasses, no I/O. Every transport carries the same frames; only where
payload bytes travel differs (inline on the TCP stream, or as tagged UCX messages).

A frame is a fixed prelude, the sizes of its payload parts, a body, then the parts:

    prelude  !HBBIIIH2x   magic 'KV', version, kind, stream, seq, body_len, num_parts  (20 B)
    sizes    !{n}Q        byte length of each payload part
    body     body_len     kind-specific, struct-packed (below)
    parts    sum(sizes)   raw bytes (inline transports only)

One transfer is one *stream* on a connection (the sender numbers its streams):

    HELLO    receiver -> sender once per connection: version, transport, connection number,
             checksums it can verify, data-plane address (UCX worker address; empty for tcp),
             host id (kernel + namespaces: UCX uses shared memory only between equal ids)
    BEGIN    header: transfer id, model fingerprint, token count, KV layout, checksum algorithm,
             wire dtype (native, int8, fp8: kvtransfer/codec.py);
             with a shared secret, then a nonce and an HMAC-SHA256 over header and nonce
    LAYER    layer index, K bytes, V bytes, checksum of K||V; parts = [K, V]
    TRAILER  first sampled token, number of layers, digest = checksum over the layer checksums;
             then, when the request asked for logprobs, the token's logprob and its top-k
    ABORT    sender gives up (prefill failed or cancelled); reason text
    RESULT   receiver -> sender: ErrorCode (OK or why it failed) and a message

K and V of a layer are the request's `num_tokens` rows of `[num_kv_heads, head_dim]` in token
order, i.e. exactly `KVCache.read_tokens(layer, block_ids, num_tokens)` as contiguous bytes
(native), or that encoded by kvtransfer/codec.py; checksums cover the bytes on the wire.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from enum import IntEnum
from typing import Any

import torch

from engine.kv_cache import KVLayout
from kvtransfer import codec
from kvtransfer.checksum import compute as compute_checksum
from kvtransfer.errors import ErrorCode, ProtocolError

MAGIC = 0x4B56  # "KV"
WIRE_VERSION = 3  # 2: HELLO carries the receiver's host id, BEGIN the wire dtype; 3: BEGIN the head piece

PRELUDE = struct.Struct("!HBBIIIH2x")
MAX_PARTS = 16
MAX_BODY = 1 << 20


class FrameKind(IntEnum):
    HELLO = 1
    BEGIN = 2
    LAYER = 3
    TRAILER = 4
    ABORT = 5
    RESULT = 6


@dataclass(frozen=True)
class Frame:
    """One protocol message. `seq` is assigned per connection by the sending channel."""

    kind: FrameKind
    stream: int = 0
    body: bytes = b""
    part_sizes: tuple[int, ...] = ()
    seq: int = 0

    @property
    def payload_nbytes(self) -> int:
        return sum(self.part_sizes)


def encode_frame_head(frame: Frame, seq: int) -> bytes:
    """Prelude + part sizes + body of `frame` sent as number `seq` on its connection."""
    if len(frame.part_sizes) > MAX_PARTS or len(frame.body) > MAX_BODY:
        raise ValueError("frame too large")
    return (
        PRELUDE.pack(MAGIC, WIRE_VERSION, frame.kind, frame.stream, seq, len(frame.body), len(frame.part_sizes))
        + struct.pack(f"!{len(frame.part_sizes)}Q", *frame.part_sizes)
        + frame.body
    )


def decode_prelude(data: bytes | memoryview) -> tuple[FrameKind, int, int, int, int]:
    """(kind, stream, seq, body_len, num_parts) of a prelude; raises ProtocolError if malformed."""
    magic, version, kind, stream, seq, body_len, num_parts = PRELUDE.unpack(data)
    if magic != MAGIC:
        raise ProtocolError(f"bad magic {magic:#x}")
    if version != WIRE_VERSION:
        raise ProtocolError(f"wire version {version} != {WIRE_VERSION}")
    if body_len > MAX_BODY or num_parts > MAX_PARTS:
        raise ProtocolError(f"frame too large: body {body_len} B, {num_parts} parts")
    try:
        return FrameKind(kind), stream, seq, body_len, num_parts
    except ValueError:
        raise ProtocolError(f"unknown frame kind {kind}") from None


def decode_frame_rest(
    kind: FrameKind, stream: int, seq: int, num_parts: int, rest: bytes | memoryview
) -> Frame:
    """Build a Frame from the bytes that follow its prelude (part sizes, then body)."""
    sizes = struct.unpack_from(f"!{num_parts}Q", rest, 0)
    return Frame(kind, stream, bytes(rest[8 * num_parts :]), tuple(sizes), seq)


# --- strings -------------------------------------------------------------------------------


def _pack_str(value: str | bytes) -> bytes:
    raw = value.encode() if isinstance(value, str) else value
    return struct.pack("!I", len(raw)) + raw


def _unpack_str(data: bytes, offset: int) -> tuple[bytes, int]:
    (n,) = struct.unpack_from("!I", data, offset)
    start = offset + 4
    if start + n > len(data):
        raise ProtocolError("truncated string field")
    return data[start : start + n], start + n


# --- bodies --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Hello:
    """Receiver's greeting: protocol and transport check, the checksums it can verify, and
    the data-plane bootstrap (UCX worker address, and the receiver's `host_id`: which kernel
    and namespaces it runs in, so a sender picks same-host transports only for a true peer)."""

    transport: str
    connection: int
    checksums: tuple[str, ...] = ("crc32",)
    data_address: bytes = b""
    host_id: str = ""

    def encode(self) -> bytes:
        return (
            struct.pack("!HI", WIRE_VERSION, self.connection)
            + _pack_str(self.transport)
            + _pack_str(",".join(self.checksums))
            + _pack_str(self.data_address)
            + _pack_str(self.host_id)
        )

    @classmethod
    def decode(cls, body: bytes) -> Hello:
        try:
            version, connection = struct.unpack_from("!HI", body, 0)
            if version != WIRE_VERSION:
                raise ProtocolError(f"peer speaks wire version {version}, we speak {WIRE_VERSION}")
            transport, off = _unpack_str(body, 6)
            checksums, off = _unpack_str(body, off)
            address, off = _unpack_str(body, off)
            host_id, _ = _unpack_str(body, off)
            return cls(transport.decode(), connection, tuple(checksums.decode().split(",")), address, host_id.decode())
        except (struct.error, UnicodeDecodeError) as exc:
            raise ProtocolError(f"malformed HELLO: {exc}") from None


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class TransferHeader:
    """What a sender announces before the first layer; validated by the receiver."""

    transfer_id: str
    fingerprint: str
    num_tokens: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: str
    checksum: str = "crc32"  # algorithm of LayerMeta.crc and Trailer.digest (kvtransfer.checksum)
    wire_dtype: str = "native"  # how K/V travel (kvtransfer.codec); decoded into `dtype` on arrival
    first_head: int = 0
    """Global index of the first of this transfer's `num_kv_heads` heads (tensor parallelism: one
    piece of a rank's heads, kvtransfer.sharding)."""
    num_pieces: int = 1
    """How many pieces (from different sender ranks) make up the receiver rank's whole transfer."""

    _FIXED = struct.Struct("!IHHHHHH")

    @classmethod
    def for_layout(cls, transfer_id: str, layout: KVLayout, num_tokens: int, fingerprint: str) -> TransferHeader:
        return cls(
            transfer_id=transfer_id,
            fingerprint=fingerprint,
            num_tokens=num_tokens,
            num_layers=layout.num_layers,
            num_kv_heads=layout.num_kv_heads,
            head_dim=layout.head_dim,
            block_size=layout.block_size,
            dtype=dtype_name(layout.dtype),
        )

    @property
    def element_size(self) -> int:
        return torch.empty((), dtype=getattr(torch, self.dtype)).element_size()

    @property
    def bytes_per_part(self) -> int:
        """Bytes on the wire of K (or of V) of one layer."""
        return codec.part_nbytes(self.num_tokens, self.num_kv_heads, self.head_dim, self.element_size, self.wire_dtype)

    @property
    def nbytes(self) -> int:
        """Payload bytes of the whole transfer (K and V of every layer)."""
        return 2 * self.num_layers * self.bytes_per_part

    def layout_mismatch(self, layout: KVLayout) -> str | None:
        """Why this header cannot land in a pool of `layout`, or None if it can."""
        ours = (layout.num_layers, layout.num_kv_heads, layout.head_dim, layout.block_size, dtype_name(layout.dtype))
        theirs = (self.num_layers, self.num_kv_heads, self.head_dim, self.block_size, self.dtype)
        if ours == theirs:
            return None
        names = ("num_layers", "num_kv_heads", "head_dim", "block_size", "dtype")
        diffs = [f"{n} {t} != {o}" for n, t, o in zip(names, theirs, ours) if t != o]
        return "layout differs: " + ", ".join(diffs)

    def encode(self) -> bytes:
        return (
            self._FIXED.pack(self.num_tokens, self.num_layers, self.num_kv_heads, self.head_dim, self.block_size, self.first_head,
                             self.num_pieces)
            + _pack_str(self.dtype)
            + _pack_str(self.transfer_id)
            + _pack_str(self.fingerprint)
            + _pack_str(self.checksum)
            + _pack_str(self.wire_dtype)
        )

    @classmethod
    def decode(cls, body: bytes) -> TransferHeader:
        """The header of a BEGIN body (an authentication suffix, if any, is ignored here)."""
        return cls.decode_with_end(body)[0]

    @classmethod
    def decode_with_end(cls, body: bytes) -> tuple[TransferHeader, int]:
        """The header and the offset where its encoding ends in `body`."""
        try:
            num_tokens, num_layers, heads, head_dim, block_size, first_head, num_pieces = cls._FIXED.unpack_from(body, 0)
            dtype, off = _unpack_str(body, cls._FIXED.size)
            transfer_id, off = _unpack_str(body, off)
            fp, off = _unpack_str(body, off)
            algorithm, off = _unpack_str(body, off)
            wire_dtype, end = _unpack_str(body, off)
            header = cls(
                transfer_id.decode(), fp.decode(), num_tokens, num_layers, heads, head_dim, block_size, dtype.decode(), algorithm.decode(),
                wire_dtype.decode(), first_head, num_pieces,
            )
        except (struct.error, UnicodeDecodeError) as exc:
            raise ProtocolError(f"malformed BEGIN: {exc}") from None
        if not isinstance(getattr(torch, header.dtype, None), torch.dtype):
            raise ProtocolError(f"unknown dtype {header.dtype!r}")
        return header, end


# --- BEGIN authentication (shared secret) ----------------------------------------------------
#
# With a cluster secret, the sender appends to the encoded header a random nonce and
# HMAC-SHA256(secret, label || header bytes || nonce): proof that it knows the secret, bound to
# this transfer id, fingerprint and layout, without the secret itself on the wire. A receiver
# with a secret refuses a BEGIN whose proof is missing or wrong before any layer is accepted.
# Transfer ids are single-use, so a replayed BEGIN finds its transfer already bound or gone.

_AUTH_LABEL = b"pdserve-kv-begin-v1\x00"
_NONCE_BYTES = 16


def _begin_mac(secret: bytes, header_bytes: bytes, nonce: bytes) -> bytes:
    return hmac.new(secret, _AUTH_LABEL + header_bytes + nonce, hashlib.sha256).digest()


def sign_begin(header_bytes: bytes, secret: bytes) -> bytes:
    """BEGIN body: the encoded header, then (with a secret) nonce and MAC; unchanged without."""
    if not secret:
        return header_bytes
    nonce = os.urandom(_NONCE_BYTES)
    return header_bytes + _pack_str(nonce) + _pack_str(_begin_mac(secret, header_bytes, nonce))


def verify_begin(body: bytes, secret: bytes) -> str | None:
    """Why `body` does not prove `secret` (a message), or None if it does (or no secret is set)."""
    if not secret:
        return None
    _, end = TransferHeader.decode_with_end(body)
    if end == len(body):
        return "BEGIN carries no authentication (the sender has no shared secret configured)"
    try:
        nonce, off = _unpack_str(body, end)
        mac, _ = _unpack_str(body, off)
    except (struct.error, ProtocolError):
        return "malformed BEGIN authentication"
    if not hmac.compare_digest(mac, _begin_mac(secret, body[:end], nonce)):
        return "BEGIN authentication does not match (the sender has a different shared secret)"
    return None


@dataclass(frozen=True)
class LayerMeta:
    layer: int
    k_nbytes: int
    v_nbytes: int
    crc: int

    _S = struct.Struct("!IQQI")

    def encode(self) -> bytes:
        return self._S.pack(self.layer, self.k_nbytes, self.v_nbytes, self.crc)

    @classmethod
    def decode(cls, body: bytes) -> LayerMeta:
        try:
            return cls(*cls._S.unpack(body))
        except struct.error as exc:
            raise ProtocolError(f"malformed LAYER: {exc}") from None


@dataclass(frozen=True)
class Trailer:
    first_token: int
    num_layers: int
    digest: int
    logprob: float | None = None
    """The first token's logprob; None when the request did not ask for logprobs."""
    top_logprobs: tuple[tuple[int, float], ...] = ()

    _S = struct.Struct("!qII")
    _LOGPROB = struct.Struct("!dH")  # logprob, number of top entries
    _TOP = struct.Struct("!Id")  # token id, logprob

    def encode(self) -> bytes:
        head = self._S.pack(self.first_token, self.num_layers, self.digest)
        if self.logprob is None:
            return head
        top = b"".join(self._TOP.pack(t, lp) for t, lp in self.top_logprobs)
        return head + self._LOGPROB.pack(self.logprob, len(self.top_logprobs)) + top

    @classmethod
    def decode(cls, body: bytes) -> Trailer:
        try:
            head = cls._S.unpack_from(body)
            if len(body) == cls._S.size:
                return cls(*head)
            logprob, n = cls._LOGPROB.unpack_from(body, cls._S.size)
            start = cls._S.size + cls._LOGPROB.size
            if len(body) != start + n * cls._TOP.size:
                raise struct.error(f"{len(body)} B for {n} top logprobs")
            top = tuple(cls._TOP.unpack_from(body, start + i * cls._TOP.size) for i in range(n))
            return cls(*head, logprob, top)
        except struct.error as exc:
            raise ProtocolError(f"malformed TRAILER: {exc}") from None


@dataclass(frozen=True)
class Result:
    code: ErrorCode
    message: str = ""

    def encode(self) -> bytes:
        return struct.pack("!B", self.code) + _pack_str(self.message)

    @classmethod
    def decode(cls, body: bytes) -> Result:
        try:
            (code,) = struct.unpack_from("!B", body, 0)
            message, _ = _unpack_str(body, 1)
            return cls(ErrorCode(code) if code in ErrorCode._value2member_map_ else ErrorCode.PROTOCOL, message.decode())
        except (struct.error, UnicodeDecodeError) as exc:
            raise ProtocolError(f"malformed RESULT: {exc}") from None


def encode_reason(reason: str) -> bytes:
    return _pack_str(reason[:4096])


def decode_reason(body: bytes) -> str:
    try:
        return _unpack_str(body, 0)[0].decode(errors="replace")
    except (struct.error, ProtocolError):
        return "<malformed reason>"


# --- fingerprint and checksums -------------------------------------------------------------

_VOLATILE_CONFIG_KEYS = ("transformers_version",)


def _stable_config(config: Any) -> Any:
    """Drop keys that differ between installs of the same model (paths, library versions)."""
    if isinstance(config, dict):
        return {
            k: _stable_config(v)
            for k, v in config.items()
            if not k.startswith("_") and k not in _VOLATILE_CONFIG_KEYS
        }
    if isinstance(config, list):
        return [_stable_config(v) for v in config]
    return config


def fingerprint(layout: KVLayout, model_config_json: str) -> str:
    """Hash of everything that must agree for KV bytes to mean the same thing on both sides:
    the model config (key order, `_`-prefixed keys and library versions ignored), KV dtype,
    block size, layer count, KV heads, head dim and the wire version. 32 hex chars."""
    try:
        config = json.loads(model_config_json) if model_config_json else {}
    except json.JSONDecodeError as exc:
        raise ValueError(f"model_config_json is not JSON: {exc}") from None
    canonical = {
        "wire_version": WIRE_VERSION,
        "model_config": _stable_config(config),
        "kv_layout": {
            "num_layers": layout.num_layers,
            "num_kv_heads": layout.num_kv_heads,
            "head_dim": layout.head_dim,
            "block_size": layout.block_size,
            "dtype": dtype_name(layout.dtype),
        },
    }
    text = json.dumps(canonical, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def digest(layer_checksums: Sequence[int], algorithm: str) -> int:
    """Transfer checksum: `algorithm` over the per-layer checksums in layer order."""
    return compute_checksum(algorithm, [struct.pack(f"!{len(layer_checksums)}I", *layer_checksums)])

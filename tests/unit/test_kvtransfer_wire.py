"""Wire format: fingerprint, frame bodies, framing, checksums, block runs, fault injector."""

from __future__ import annotations

import json
import zlib

import numpy as np
import pytest
import torch

from engine.kv_cache import KVLayout
from kvtransfer import checksum
from kvtransfer.buffers import block_runs
from kvtransfer.errors import (
    ChecksumMismatch,
    ErrorCode,
    ProtocolError,
    error_from_code,
)
from kvtransfer.faults import FaultInjector
from kvtransfer.wire import (
    PRELUDE,
    Frame,
    FrameKind,
    Hello,
    LayerMeta,
    Result,
    Trailer,
    TransferHeader,
    decode_frame_rest,
    decode_prelude,
    digest,
    encode_frame_head,
    fingerprint,
)

LAYOUT = KVLayout(num_layers=30, num_kv_heads=3, head_dim=64, block_size=16, dtype=torch.float32)
CONFIG = {"model_type": "llama", "hidden_size": 576, "num_hidden_layers": 30, "_name_or_path": "/a/b"}


def test_fingerprint_ignores_key_order_paths_and_versions() -> None:
    other = dict(reversed(list(CONFIG.items())))
    other["_name_or_path"] = "/somewhere/else"
    other["transformers_version"] = "9.9"
    assert fingerprint(LAYOUT, json.dumps(CONFIG)) == fingerprint(LAYOUT, json.dumps(other))
    assert len(fingerprint(LAYOUT, json.dumps(CONFIG))) == 32


@pytest.mark.parametrize(
    "change",
    [
        {"dtype": torch.bfloat16},
        {"block_size": 32},
        {"num_layers": 29},
        {"num_kv_heads": 4},
        {"head_dim": 32},
    ],
)
def test_fingerprint_changes_with_layout(change: dict) -> None:
    fields = {**LAYOUT.__dict__, **change}
    assert fingerprint(KVLayout(**fields), json.dumps(CONFIG)) != fingerprint(LAYOUT, json.dumps(CONFIG))


def test_fingerprint_changes_with_model_config() -> None:
    assert fingerprint(LAYOUT, json.dumps({**CONFIG, "hidden_size": 577})) != fingerprint(LAYOUT, json.dumps(CONFIG))
    with pytest.raises(ValueError, match="not JSON"):
        fingerprint(LAYOUT, "{nope")


def test_bodies_roundtrip() -> None:
    header = TransferHeader.for_layout("req-1/xfer-7", LAYOUT, 1000, "f" * 32)
    assert TransferHeader.decode(header.encode()) == header
    assert header.bytes_per_part == 1000 * 3 * 64 * 4
    assert header.nbytes == 1000 * 46080
    assert header.layout_mismatch(LAYOUT) is None
    other = KVLayout(30, 3, 64, 16, torch.float16)
    assert "dtype float32 != float16" in (header.layout_mismatch(other) or "")
    meta = LayerMeta(29, 10, 10, 0xDEADBEEF)
    assert LayerMeta.decode(meta.encode()) == meta
    trailer = Trailer(-1, 30, 123)
    assert Trailer.decode(trailer.encode()) == trailer
    result = Result(ErrorCode.CHECKSUM_MISMATCH, "layer 3")
    assert Result.decode(result.encode()) == result
    hello = Hello("ucx", 7, ("crc32c", "crc32"), b"\x00addr", "boot:1:2:3")
    assert Hello.decode(hello.encode()) == hello
    header = TransferHeader.for_layout("t", LAYOUT, 5, "f")
    assert header.checksum == "crc32"
    with_crc32c = TransferHeader("t", "f", 5, 30, 3, 64, 16, "float32", "crc32c")
    assert TransferHeader.decode(with_crc32c.encode()).checksum == "crc32c"


def test_malformed_bodies_raise_protocol_error() -> None:
    header = TransferHeader.for_layout("x", LAYOUT, 10, "f").encode()
    with pytest.raises(ProtocolError):
        TransferHeader.decode(header[:-3])
    with pytest.raises(ProtocolError):
        LayerMeta.decode(b"\x00" * 5)
    bad_dtype = TransferHeader("x", "f", 1, 1, 1, 1, 16, "notatype").encode()
    with pytest.raises(ProtocolError, match="dtype"):
        TransferHeader.decode(bad_dtype)


def test_frame_framing_roundtrip() -> None:
    frame = Frame(FrameKind.LAYER, stream=5, body=b"meta", part_sizes=(12, 34))
    head = encode_frame_head(frame, seq=9)
    kind, stream, seq, body_len, num_parts = decode_prelude(head[: PRELUDE.size])
    decoded = decode_frame_rest(kind, stream, seq, num_parts, head[PRELUDE.size :])
    assert decoded == Frame(FrameKind.LAYER, 5, b"meta", (12, 34), 9)
    assert body_len == 4 and decoded.payload_nbytes == 46
    corrupt = bytearray(head)
    corrupt[0] ^= 0xFF
    with pytest.raises(ProtocolError, match="magic"):
        decode_prelude(bytes(corrupt[: PRELUDE.size]))


def test_checksums() -> None:
    a, b = np.arange(100, dtype=np.uint8), np.arange(50, dtype=np.uint8)
    assert checksum.compute("crc32", [a, b]) == zlib.crc32(a.tobytes() + b.tobytes())
    assert digest([1, 2], "crc32") != digest([2, 1], "crc32")
    assert "crc32" in checksum.supported()
    assert checksum.choose(["crc32"]) == "crc32"
    assert checksum.choose([]) == "crc32"  # an old peer: the always-available default
    assert checksum.choose(["crc32c", "crc32"], preferences=["crc32"]) == "crc32"


def test_crc32c_when_available() -> None:
    pytest.importorskip("crc32c")
    a = np.frombuffer(b"123456789", dtype=np.uint8)
    assert checksum.compute("crc32c", [a[:4], a[4:]]) == 0xE3069283  # the standard check value
    assert checksum.choose(["crc32c", "crc32"]) == checksum.supported()[0]


def test_error_codes_map_to_exceptions() -> None:
    err = error_from_code(ErrorCode.CHECKSUM_MISMATCH, "bad", "t1")
    assert isinstance(err, ChecksumMismatch) and err.transfer_id == "t1" and "t1" in str(err)
    assert isinstance(error_from_code(99, "?"), ProtocolError)


def test_block_runs() -> None:
    assert block_runs([4, 5, 6, 9, 10, 2], 70, 16) == [(4, 3, 48), (9, 2, 22)]
    assert block_runs([7], 3, 16) == [(7, 1, 3)]
    with pytest.raises(ValueError):
        block_runs([1], 17, 16)


def test_trailer_carries_the_first_tokens_logprobs() -> None:
    trailer = Trailer(7, 30, 123, -0.25, ((7, -0.25), (9, -1.5)))
    assert Trailer.decode(trailer.encode()) == trailer
    assert Trailer.decode(Trailer(7, 30, 123, -0.25).encode()).top_logprobs == ()
    assert len(Trailer(7, 30, 123).encode()) < len(Trailer(7, 30, 123, 0.0).encode())  # no logprob asked: not sent
    with pytest.raises(ProtocolError, match="TRAILER"):
        Trailer.decode(trailer.encode()[:-1])


def test_fault_injector_from_env_and_tamper() -> None:
    inj = FaultInjector.from_env({"PDSERVE_KV_FAULTS": "corrupt:t1:3,corrupt:tamper-*:5,corrupt:*:0"})
    assert inj is not None and inj.corrupt == {"t1": 3, "tamper-*": 5, "*": 0}
    assert FaultInjector.from_env({}) is None
    with pytest.raises(ValueError):
        FaultInjector.from_env({"PDSERVE_KV_FAULTS": "explode:t1"})
    part = np.zeros(8, dtype=np.uint8)
    assert inj.tamper("t1", 2, [part])[0] is part
    damaged = inj.tamper("t1", 3, [part])[0]
    assert damaged is not part and damaged.sum() == 0xFF and part.sum() == 0
    assert inj.tamper("other", 0, [part])[0] is not part
    assert inj.tamper("tamper-17", 5, [part])[0] is not part
    assert inj.tamper("tamper-17", 4, [part])[0] is part
    assert inj.tampered == [("t1", 3), ("other", 0), ("tamper-17", 5)]

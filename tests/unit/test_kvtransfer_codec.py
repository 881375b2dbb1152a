"""KV compression on the wire (kvtransfer/codec.py): sizes, round trip error, the auto policy, config."""

from __future__ import annotations

import pytest
import torch

from common.config import ConfigError, config_from_dict
from kvtransfer import ChecksumMismatch, codec
from tests.unit.test_kvtransfer_transfer import DST_BLOCKS, FP, LAYOUT, SRC_BLOCKS, N, filled_cache, header, rig  # noqa: F401 (rig: fixture)


@pytest.mark.parametrize("wire_dtype, bound", [("int8", 0.5 / 127 + 1e-6), ("fp8", 0.07)])
def test_roundtrip_error_is_bounded_per_row(wire_dtype, bound):
    torch.manual_seed(0)
    k = torch.randn(37, 3, 64) * torch.logspace(-3, 2, 37)[:, None, None]  # rows of very different magnitude
    assert 0 < codec.roundtrip_error([k], 64, wire_dtype) <= bound


def test_encoded_size_and_decode_into_native_dtype():
    t = torch.randn(5, 3, 64, dtype=torch.bfloat16)
    buf = codec.encode(t, 64, "int8")
    assert len(buf) == codec.part_nbytes(5, 3, 64, 2, "int8") == 15 * (4 + 64)
    back = codec.decode(buf, 15, 64, "int8", torch.bfloat16)
    assert back.dtype == torch.bfloat16 and back.shape == (15, 64)
    assert torch.allclose(back.float(), t.reshape(15, 64).float(), atol=float(t.abs().max()) / 100)
    assert codec.part_nbytes(5, 3, 64, 4, "native") == 5 * 3 * 64 * 4


def test_auto_compresses_only_below_the_threshold():
    policy = codec.WirePolicy("auto", compress_below_gbps=5.0)
    assert policy.choose("b") == "native"  # nothing measured yet
    policy.record("b", 1 << 20, 1.0)  # a small transfer: round trips, not a rate
    assert policy.gbps("b") is None
    policy.record("b", 125_000_000, 1.0)  # 1 Gbit/s
    policy.record("c", 3_125_000_000, 1.0)  # 25 Gbit/s
    assert (policy.choose("b"), policy.choose("c")) == ("int8", "native")
    assert codec.WirePolicy("fp8").choose("c") == "fp8"


@pytest.mark.parametrize("field, value", [("wire_dtype", "int4"), ("wire_dtype", 8), ("compress_below_gbps", 0),
                                          ("compress_below_gbps", "fast")])
def test_bad_wire_fields_are_refused_naming_the_field(field, value):
    with pytest.raises(ConfigError) as info:
        config_from_dict({"kv_transfer": {field: value}})
    assert f"kv_transfer.{field}" in str(info.value)


@pytest.mark.parametrize("wire_dtype", ["int8", "fp8"])
async def test_compressed_transfer_lands_close_to_source(rig, wire_dtype):  # noqa: F811 (pytest fixture)
    receiver, dst, sender, endpoint = rig
    sender.wire = codec.WirePolicy(wire_dtype)
    src = filled_cache(3)
    fut = receiver.expect("z", DST_BLOCKS, N, FP, timeout=10)
    xfer = sender.begin(endpoint, header("z"))
    xfer.send_from_cache(src, SRC_BLOCKS)
    xfer.finish(first_token=5)
    assert (await fut).first_token == 5
    ack = await xfer.wait(10)
    rows = N * LAYOUT.num_kv_heads
    assert xfer.header.wire_dtype == wire_dtype and ack.nbytes == 2 * LAYOUT.num_layers * rows * (4 + LAYOUT.head_dim)
    for layer in range(LAYOUT.num_layers):
        for sent, got in zip(src.read_tokens(layer, SRC_BLOCKS, N), dst.read_tokens(layer, DST_BLOCKS, N), strict=True):
            scale = sent.abs().amax(dim=-1, keepdim=True)
            assert not torch.equal(sent, got)  # lossy indeed
            assert float(((sent - got).abs() / scale).max()) <= 0.07
    assert receiver.pending == 0


async def test_corrupted_compressed_layer_is_rejected(rig):  # noqa: F811 (pytest fixture)
    receiver, _, sender, endpoint = rig
    sender.wire = codec.WirePolicy("int8")
    fut = receiver.expect("bad", DST_BLOCKS, N, FP, timeout=10)
    xfer = sender.begin(endpoint, header("bad"))  # the rig's sender corrupts layer 2 of "bad"
    xfer.send_from_cache(filled_cache(), SRC_BLOCKS)
    xfer.finish(1)
    with pytest.raises(ChecksumMismatch, match="layer 2"):
        await fut
    assert receiver.pending == 0 and receiver.stats.completed == 0

"""Sender -> receiver in one process (local and tcp transports), into a real KVCache."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
import threading

import pytest
import torch

from engine.kv_cache import KVCache, KVLayout
from kvtransfer import (
    ChecksumMismatch,
    FaultInjector,
    FingerprintMismatch,
    KVEndpoint,
    KVReceiver,
    KVSender,
    ShapeMismatch,
    TransferAborted,
    TransferHeader,
    TransferTimeout,
    UnknownTransfer,
    checksum,
    fingerprint,
)

LAYOUT = KVLayout(num_layers=4, num_kv_heads=2, head_dim=8, block_size=4, dtype=torch.float32)
FP = fingerprint(LAYOUT, json.dumps({"model_type": "tiny"}))
SRC_BLOCKS = [1, 2, 3, 7, 8]
DST_BLOCKS = [10, 11, 5, 6, 12]  # two runs of consecutive blocks plus a single one
N = 18  # 5 blocks of 4, last one partly used

pytestmark = pytest.mark.timeout(60)


def filled_cache(seed: int = 0) -> KVCache:
    cache = KVCache(LAYOUT, num_blocks=16)
    gen = torch.Generator().manual_seed(seed)
    for layer in range(LAYOUT.num_layers):
        cache.key_caches[layer].copy_(torch.randn(cache.key_caches[layer].shape, generator=gen))
        cache.value_caches[layer].copy_(torch.randn(cache.value_caches[layer].shape, generator=gen))
    return cache


def assert_same_kv(src: KVCache, dst: KVCache, src_blocks: list[int], dst_blocks: list[int], n: int) -> None:
    for layer in range(LAYOUT.num_layers):
        sk, sv = src.read_tokens(layer, src_blocks, n)
        dk, dv = dst.read_tokens(layer, dst_blocks, n)
        assert torch.equal(sk, dk) and torch.equal(sv, dv), f"layer {layer} differs"


def header(tid: str, n: int = N, fp: str = FP, layout: KVLayout = LAYOUT) -> TransferHeader:
    return TransferHeader.for_layout(tid, layout, n, fp)


HAVE_UCX = importlib.util.find_spec("ucxx") is not None  # not imported here: kvtransfer sets UCX env first
TRANSPORTS = ["local", "tcp", pytest.param("ucx", marks=pytest.mark.skipif(not HAVE_UCX, reason="ucxx missing"))]


@pytest.fixture(params=TRANSPORTS)
async def rig(request: pytest.FixtureRequest):
    """(receiver, dst cache, sender, endpoint) with a fresh destination pool. In-process: the
    sender's loop and the receiver's loop each drive their own UCX worker."""
    dst = KVCache(LAYOUT, num_blocks=16)
    receiver = KVReceiver(dst, request.param, settle_timeout=2.0)
    endpoint = await receiver.start()
    sender = KVSender(connect_timeout=5.0, ack_timeout=10.0, faults=FaultInjector(corrupt={"bad": 2}))
    yield receiver, dst, sender, endpoint
    await asyncio.to_thread(sender.close)
    await receiver.close()


async def test_roundtrip_equals_source(rig) -> None:
    receiver, dst, sender, endpoint = rig
    src = filled_cache()
    fut = receiver.expect("t1", DST_BLOCKS, N, FP, timeout=10)
    xfer = sender.begin(endpoint, header("t1"))
    xfer.send_from_cache(src, SRC_BLOCKS)
    xfer.finish(first_token=1234)
    received = await fut
    ack = await xfer.wait(10)
    assert received.first_token == 1234 and received.num_tokens == N
    assert received.nbytes == ack.nbytes == 2 * LAYOUT.num_layers * N * 2 * 8 * 4
    assert_same_kv(src, dst, SRC_BLOCKS, DST_BLOCKS, N)
    assert receiver.pending == 0 and receiver.stats.completed == 1
    assert sender.stats.bytes_sent == ack.nbytes
    assert xfer.header.checksum == checksum.supported()[0]  # negotiated: fastest both support


async def test_first_token_logprobs_travel_in_the_trailer(rig) -> None:
    receiver, dst, sender, endpoint = rig
    fut = receiver.expect("lp", DST_BLOCKS, N, FP, timeout=10)
    xfer = sender.begin(endpoint, header("lp"))
    xfer.send_from_cache(filled_cache(3), SRC_BLOCKS)
    xfer.finish(first_token=11, logprob=-0.5, top_logprobs={11: -0.5, 12: -2.0})
    received = await fut
    await xfer.wait(10)
    assert (received.first_token, received.first_logprob, received.first_top_logprobs) == (11, -0.5, {11: -0.5, 12: -2.0})


async def test_staging_path_layers_out_of_order_zlib_crc32(rig) -> None:
    receiver, dst, sender, endpoint = rig
    receiver.zero_copy = False
    sender.checksums = ("crc32",)
    src = filled_cache(1)
    fut = receiver.expect("t2", DST_BLOCKS, N, FP, timeout=10)
    xfer = sender.begin(endpoint, header("t2"))
    xfer.send_from_cache(src, SRC_BLOCKS, layers=range(3, -1, -1))
    xfer.finish(first_token=7)
    assert (await fut).first_token == 7
    assert xfer.header.checksum == "crc32"
    assert_same_kv(src, dst, SRC_BLOCKS, DST_BLOCKS, N)


async def test_concurrent_transfers_share_one_connection(rig) -> None:
    receiver, dst, sender, endpoint = rig
    src = filled_cache(2)
    plans = {f"c{i}": ([i], [8 + i]) for i in range(4)}  # one block each, 4 tokens
    futs = {tid: receiver.expect(tid, d, 4, FP, timeout=10) for tid, (_, d) in plans.items()}
    xfers = [sender.begin(endpoint, header(tid, 4)) for tid in plans]
    for layer in range(LAYOUT.num_layers):  # interleave layers of all transfers
        for xfer in xfers:
            k, v = src.read_tokens(layer, plans[xfer.transfer_id][0], 4)
            xfer.send_layer(layer, k, v)
    for i, xfer in enumerate(xfers):
        xfer.finish(first_token=i)
    results = await asyncio.gather(*futs.values())
    assert [r.first_token for r in results] == [0, 1, 2, 3]
    for s, d in plans.values():
        assert_same_kv(src, dst, s, d, 4)
    assert len(sender._connections) == 1


async def test_send_layer_from_engine_thread(rig) -> None:
    receiver, dst, sender, endpoint = rig
    src = filled_cache(3)
    fut = receiver.expect("t3", DST_BLOCKS, N, FP, timeout=10)

    def engine() -> None:  # what the prefill engine thread does
        xfer = sender.begin(endpoint, header("t3"))
        for layer in range(LAYOUT.num_layers):
            xfer.send_layer(layer, *src.read_tokens(layer, SRC_BLOCKS, N))
        xfer.finish(99).result(timeout=10)

    thread = threading.Thread(target=engine)
    thread.start()
    assert (await fut).first_token == 99
    await asyncio.to_thread(thread.join, 10)
    assert_same_kv(src, dst, SRC_BLOCKS, DST_BLOCKS, N)


async def test_fingerprint_mismatch(rig) -> None:
    receiver, _, sender, endpoint = rig
    fut = receiver.expect("t4", DST_BLOCKS, N, FP, timeout=10)
    xfer = sender.begin(endpoint, header("t4", fp="0" * 32))
    xfer.send_from_cache(filled_cache(), SRC_BLOCKS)
    xfer.finish(1)
    with pytest.raises(FingerprintMismatch):
        await fut
    with pytest.raises(FingerprintMismatch):
        await xfer.wait(10)
    assert receiver.pending == 0 and receiver.stats.completed == 0


@pytest.mark.parametrize(
    "bad",
    [
        "num_tokens",
        "layout",
        "tensor",
    ],
)
async def test_shape_mismatch(rig, bad: str) -> None:
    receiver, _, sender, endpoint = rig
    fut = receiver.expect("t5", DST_BLOCKS, N, FP, timeout=10)
    if bad == "num_tokens":
        xfer = sender.begin(endpoint, header("t5", n=N - 1))
    elif bad == "layout":
        xfer = sender.begin(endpoint, header("t5", layout=KVLayout(4, 2, 8, 8, torch.float32)))
    else:
        xfer = sender.begin(endpoint, header("t5"))
        xfer.send_layer(0, torch.zeros(N, 2, 8), torch.zeros(N, 2, 8))
        # A receiver sees wrong payload sizes; the sender refuses to even send them:
        xfer.send_layer(1, torch.zeros(N, 2, 4), torch.zeros(N, 2, 4))
    with pytest.raises(ShapeMismatch):
        await xfer.wait(10)
    if bad == "tensor":  # the sender gives up and tells the receiver
        with pytest.raises(TransferAborted, match="sender aborted"):
            await fut
    else:
        with pytest.raises(ShapeMismatch):
            await fut
    assert receiver.stats.completed == 0


async def test_checksum_mismatch_is_rejected(rig) -> None:
    receiver, _, sender, endpoint = rig
    fut = receiver.expect("bad", DST_BLOCKS, N, FP, timeout=10)
    xfer = sender.begin(endpoint, header("bad"))
    xfer.send_from_cache(filled_cache(), SRC_BLOCKS)
    xfer.finish(1)
    with pytest.raises(ChecksumMismatch, match="layer 2"):
        await fut
    with pytest.raises(ChecksumMismatch):
        await xfer.wait(10)
    assert sender.faults is not None and sender.faults.tampered == [("bad", 2)]
    assert receiver.pending == 0 and receiver.stats.completed == 0
    # The connection survives: the next transfer on it works.
    src = filled_cache(4)
    fut = receiver.expect("good", DST_BLOCKS, N, FP, timeout=10)
    xfer = sender.begin(endpoint, header("good"))
    xfer.send_from_cache(src, SRC_BLOCKS)
    xfer.finish(2)
    assert (await fut).first_token == 2


async def test_timeout_without_sender(rig) -> None:
    receiver, _, _, _ = rig
    fut = receiver.expect("t6", DST_BLOCKS, N, FP, timeout=0.2)
    with pytest.raises(TransferTimeout, match="no sender began"):
        await asyncio.wait_for(fut, 5)
    assert receiver.pending == 0


async def test_timeout_mid_transfer_tells_sender(rig) -> None:
    receiver, _, sender, endpoint = rig
    fut = receiver.expect("t7", DST_BLOCKS, N, FP, timeout=0.5)
    xfer = sender.begin(endpoint, header("t7"))
    xfer.send_from_cache(filled_cache(), SRC_BLOCKS, layers=range(2))  # stalls after 2 layers
    with pytest.raises(TransferTimeout, match="2 layers verified"):
        await asyncio.wait_for(fut, 5)
    with pytest.raises(TransferTimeout):
        await xfer.wait(5)


async def test_unknown_transfer(rig) -> None:
    _, _, sender, endpoint = rig
    xfer = sender.begin(endpoint, header("nobody-expects-this"))
    xfer.send_from_cache(filled_cache(), SRC_BLOCKS)
    xfer.finish(1)
    with pytest.raises(UnknownTransfer):
        await xfer.wait(10)


async def test_cancel_and_sender_abort(rig) -> None:
    receiver, _, sender, endpoint = rig
    fut = receiver.expect("t8", DST_BLOCKS, N, FP, timeout=10)
    xfer = sender.begin(endpoint, header("t8"))
    xfer.send_from_cache(filled_cache(), SRC_BLOCKS, layers=range(1))
    await asyncio.sleep(0.1)
    assert receiver.cancel("t8") and not receiver.cancel("t8")
    with pytest.raises(TransferAborted, match="cancelled"):
        await fut
    with pytest.raises((TransferAborted, UnknownTransfer)):  # UnknownTransfer: its BEGIN came after the cancel
        await xfer.wait(10)

    fut = receiver.expect("t9", DST_BLOCKS, N, FP, timeout=10)
    xfer = sender.begin(endpoint, header("t9"))
    xfer.send_from_cache(filled_cache(), SRC_BLOCKS, layers=range(1))
    xfer.abort("prefill failed")
    with pytest.raises(TransferAborted, match="prefill failed"):
        await fut
    assert receiver.stats.completed == 0 and receiver.pending == 0


async def test_cancel_after_the_waiter_was_cancelled_still_fails_the_transfer(rig, caplog) -> None:
    """A decode call cancelled while awaiting the transfer cancels its future; the receiver must still
    forget the transfer, tell the sender and log it (it once returned silently and kept it pending)."""
    receiver, _, sender, endpoint = rig
    fut = receiver.expect("t8b", DST_BLOCKS, N, FP, timeout=10)
    xfer = sender.begin(endpoint, header("t8b"))
    xfer.send_from_cache(filled_cache(), SRC_BLOCKS, layers=range(1))
    waiter = asyncio.ensure_future(fut)
    await asyncio.sleep(0.1)
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    with caplog.at_level("WARNING", logger="kvtransfer.receiver"):
        assert receiver.cancel("t8b")
    assert receiver.pending == 0
    assert any("[t8b]" in r.getMessage() and "cancelled" in r.getMessage() for r in caplog.records), caplog.records
    with pytest.raises((TransferAborted, UnknownTransfer)):
        await xfer.wait(10)


async def test_receiver_close_fails_pending_and_sender_sees_it(rig) -> None:
    receiver, _, sender, endpoint = rig
    fut = receiver.expect("t10", DST_BLOCKS, N, FP, timeout=10)
    xfer = sender.begin(endpoint, header("t10"))
    xfer.send_from_cache(filled_cache(), SRC_BLOCKS, layers=range(1))
    await asyncio.sleep(0.1)
    await receiver.close()
    with pytest.raises(TransferAborted):
        await fut
    with pytest.raises(TransferAborted):
        await xfer.wait(10)


async def test_connect_failure_is_typed(rig) -> None:
    _, _, sender, endpoint = rig
    nowhere = KVEndpoint(endpoint.host, 1, endpoint.transport)
    xfer = sender.begin(nowhere, header("t11"))
    with pytest.raises(TransferAborted, match="connection lost|connect"):
        await xfer.wait(10)


async def test_expect_validates_arguments(rig) -> None:
    receiver, _, _, _ = rig
    with pytest.raises(ValueError):
        receiver.expect("t12", [99], 4, FP, timeout=1)  # block out of range
    with pytest.raises(ValueError):
        receiver.expect("t12", [1], 5, FP, timeout=1)  # 5 tokens do not fit one block of 4
    fut = receiver.expect("t12", [1], 4, FP, timeout=1)
    with pytest.raises(ValueError, match="already expected"):
        receiver.expect("t12", [2], 4, FP, timeout=1)
    receiver.cancel("t12")
    with pytest.raises(TransferAborted):
        await fut


async def test_garbage_connection_is_dropped_and_receiver_keeps_serving() -> None:
    dst = KVCache(LAYOUT, num_blocks=16)
    async with KVReceiver(dst, "tcp") as receiver:
        reader, writer = await asyncio.open_connection(receiver.endpoint.host, receiver.endpoint.port)
        await reader.read(1)  # the HELLO starts arriving
        writer.write(b"\x00" * 64)  # not a frame
        await writer.drain()
        with contextlib.suppress(ConnectionResetError):  # the receiver hangs up (EOF or RST)
            await asyncio.wait_for(reader.read(), 5)
        writer.close()
        sender = KVSender(ack_timeout=10.0)
        try:
            src = filled_cache(5)
            fut = receiver.expect("t13", DST_BLOCKS, N, FP, timeout=10)
            xfer = sender.begin(receiver.endpoint, header("t13"))
            xfer.send_from_cache(src, SRC_BLOCKS)
            xfer.finish(3)
            assert (await fut).first_token == 3
            assert_same_kv(src, dst, SRC_BLOCKS, DST_BLOCKS, N)
        finally:
            await asyncio.to_thread(sender.close)


async def test_send_after_finish_is_a_caller_error(rig) -> None:
    receiver, _, sender, endpoint = rig
    fut = receiver.expect("t14", DST_BLOCKS, N, FP, timeout=10)
    xfer = sender.begin(endpoint, header("t14"))
    xfer.send_from_cache(filled_cache(), SRC_BLOCKS)
    xfer.finish(1)
    with pytest.raises(RuntimeError, match="after finish"):
        xfer.send_layer(0, torch.zeros(N, 2, 8), torch.zeros(N, 2, 8))
    await fut
    await xfer.wait(10)

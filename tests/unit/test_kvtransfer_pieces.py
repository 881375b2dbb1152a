"""KV between tensor-parallel workers of different TP sizes: every prefill rank sends each decode
rank exactly the heads both own (kvtransfer.sharding), as pieces the decode rank's receiver
assembles (kvtransfer.pieces). Each decode rank's pool ends up holding its heads of the source KV."""

from __future__ import annotations

import asyncio
import dataclasses
import importlib.util
import json

import pytest
import torch

from engine.kv_cache import KVCache, KVLayout
from kvtransfer import KVEndpoint, KVReceiver, KVSender, ShapeMismatch, TransferAborted, TransferHeader, TransferTimeout, fingerprint
from kvtransfer.pieces import Destination, PieceSend
from kvtransfer.sharding import HeadRange, IncompatibleLayouts, check_compatible, head_range, pieces

HEADS = 4
GLOBAL = KVLayout(num_layers=3, num_kv_heads=HEADS, head_dim=8, block_size=4, dtype=torch.float32)
FP = fingerprint(GLOBAL, json.dumps({"model_type": "tiny"}))
N = 13
SRC_BLOCKS = [2, 3, 9, 4]
DST_BLOCKS = [5, 6, 7, 1]

pytestmark = pytest.mark.timeout(60)
HAVE_UCX = importlib.util.find_spec("ucxx") is not None
TRANSPORTS = ["tcp", pytest.param("ucx", marks=pytest.mark.skipif(not HAVE_UCX, reason="ucxx missing"))]


@pytest.fixture
async def sender():
    sender = KVSender(ack_timeout=10.0)
    yield sender
    await asyncio.to_thread(sender.close)


def source() -> KVCache:
    """The prompt's KV with every head, as one unsplit model would hold it."""
    cache = KVCache(GLOBAL, num_blocks=12)
    gen = torch.Generator().manual_seed(0)
    for layer in range(GLOBAL.num_layers):
        cache.key_caches[layer].copy_(torch.randn(cache.key_caches[layer].shape, generator=gen))
        cache.value_caches[layer].copy_(torch.randn(cache.value_caches[layer].shape, generator=gen))
    return cache


class DecodeRanks:
    """One receiver per decode rank, each over a pool of its own heads."""

    def __init__(self, tp: int, transport: str):
        self.tp = tp
        self.caches = [KVCache(dataclasses.replace(GLOBAL, num_kv_heads=HEADS // tp), num_blocks=12) for _ in range(tp)]
        self.receivers = [KVReceiver(c, transport, heads=head_range(HEADS, tp, s), settle_timeout=2.0) for s, c in enumerate(self.caches)]

    async def __aenter__(self):
        self.endpoints = [await r.start() for r in self.receivers]
        return self

    async def __aexit__(self, *exc):
        for r in self.receivers:
            await r.close()


def send_pieces(sender: KVSender, src: KVCache, ranks: DecodeRanks, src_tp: int, transfer_id: str, skip: set[int] = frozenset()):
    """Every prefill rank's PieceSend, fed that rank's heads of `src`; rank 0 carries the first token."""
    destination = Destination(transfer_id, FP, ranks.endpoints, HEADS)
    sends = []
    for rank in range(src_tp):
        if rank in skip:
            continue
        send = PieceSend(sender, destination, GLOBAL, N, rank, src_tp)
        mine = head_range(HEADS, src_tp, rank)
        for layer in range(GLOBAL.num_layers):
            k, v = src.read_tokens(layer, SRC_BLOCKS, N)
            send.send_layer(layer, k[:, mine.first:mine.end].contiguous(), v[:, mine.first:mine.end].contiguous())
        send.finish(first_token=42 if rank == 0 else 0)
        sends.append(send)
    return sends


@pytest.mark.parametrize("src_tp,dst_tp", [(2, 1), (1, 2), (2, 2), (4, 2), (1, 4)])
@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_every_decode_rank_gets_exactly_its_heads(src_tp, dst_tp, transport):
    src = source()
    sender = KVSender(ack_timeout=10.0)
    try:
        async with DecodeRanks(dst_tp, transport) as ranks:
            futures = [r.expect_pieces("t", DST_BLOCKS, N, FP, timeout=10) for r in ranks.receivers]
            transfers = send_pieces(sender, src, ranks, src_tp, "t")
            received = await asyncio.gather(*futures)
            sent = [await send.wait(10) for send in transfers]
            assert sum(sent) == sum(r.nbytes for r in received)
            assert received[0].first_token == 42
            for s, cache in enumerate(ranks.caches):
                mine = head_range(HEADS, dst_tp, s)
                for layer in range(GLOBAL.num_layers):
                    want_k, want_v = src.read_tokens(layer, SRC_BLOCKS, N)
                    got_k, got_v = cache.read_tokens(layer, DST_BLOCKS, N)
                    assert torch.equal(got_k, want_k[:, mine.first:mine.end]) and torch.equal(got_v, want_v[:, mine.first:mine.end])
                assert received[s].nbytes == 2 * GLOBAL.num_layers * N * mine.count * 8 * 4
            assert all(r.pending == 0 for r in ranks.receivers)
    finally:
        await asyncio.to_thread(sender.close)


async def test_a_missing_piece_times_out_and_the_others_are_aborted(sender):
    async with DecodeRanks(1, "tcp") as ranks:
        fut = ranks.receivers[0].expect_pieces("m", DST_BLOCKS, N, FP, timeout=1.0)
        (sent,) = send_pieces(sender, source(), ranks, 2, "m", skip={1})
        with pytest.raises(TransferTimeout):
            await fut
        with pytest.raises(TransferTimeout):
            await sent.wait(10)
        assert ranks.receivers[0].pending == 0


async def test_a_piece_outside_the_ranks_heads_is_refused(sender):
    async with DecodeRanks(2, "tcp") as ranks:
        fut = ranks.receivers[1].expect_pieces("o", DST_BLOCKS, N, FP, timeout=5)
        header = dataclasses.replace(TransferHeader.for_layout("o#0", GLOBAL, N, FP), num_kv_heads=2, first_head=0)
        xfer = sender.begin(ranks.endpoints[1], header)  # heads [0, 2) belong to rank 0
        with pytest.raises(ShapeMismatch, match=r"heads \[0, 2\) do not fit this rank's heads \[2, 4\)"):
            await fut
        with pytest.raises(ShapeMismatch):
            await xfer.wait(10)


async def test_cancel_fails_a_group_waiting_for_pieces():
    async with DecodeRanks(1, "tcp") as ranks:
        receiver = ranks.receivers[0]
        fut = receiver.expect_pieces("c", DST_BLOCKS, N, FP, timeout=5)
        assert receiver.pending == 1 and receiver.cancel("c")
        with pytest.raises(TransferAborted):
            await fut
        assert receiver.pending == 0


def test_sharding_math():
    assert head_range(6, 3, 2) == HeadRange(4, 2)
    assert [(p.src, p.dst, p.heads) for p in pieces(4, 2, 1)] == [(0, 0, HeadRange(0, 2)), (1, 0, HeadRange(2, 2))]
    assert [(p.src, p.dst) for p in pieces(4, 1, 2)] == [(0, 0), (0, 1)]
    assert sum(p.heads.count for p in pieces(12, 4, 3)) == 12  # every head once, even when ranges straddle
    with pytest.raises(IncompatibleLayouts, match="prefill worker TP=2 with 4 KV heads, decode worker TP=3 with 3 KV heads"):
        check_compatible((2, 4), (3, 3))
    with pytest.raises(IncompatibleLayouts, match="TP=2 does not divide"):
        check_compatible((2, 3), (1, 3))


async def test_a_prefill_worker_refuses_a_decode_layout_it_cannot_fill_before_sending(sender):
    three_ranks = Destination("x", FP, [KVEndpoint("127.0.0.1", 1, "tcp")] * 3, 3)
    with pytest.raises(IncompatibleLayouts, match="prefill worker TP=2 with 4 KV heads, decode worker TP=3 with 3 KV heads"):
        PieceSend(sender, three_ranks, GLOBAL, N, 0, 2)
    assert sender.stats.bytes_sent == 0


def test_the_prefill_worker_refuses_a_destination_up_front_naming_both_sides():
    from prefill_worker.service import layout_refusal
    from proto.pdserve.v1 import pdserve_pb2 as pb

    two_ranks = [pb.KVEndpoint(host="127.0.0.1", port=p, transport="ucx") for p in (1, 2)]
    other_model = pb.KVDestination(transfer_id="t", model_fingerprint="f" * 32, rank_endpoints=two_ranks, num_kv_heads=8)
    refusal = layout_refusal(other_model, FP, 1, HEADS)
    assert refusal.startswith("kv_destination.model_fingerprint:")
    assert "decode worker TP=2 with 8 KV heads, this prefill worker TP=1 with 4 KV heads" in refusal
    same_model = pb.KVDestination(transfer_id="t", model_fingerprint=FP, rank_endpoints=two_ranks, num_kv_heads=HEADS)
    assert layout_refusal(same_model, FP, 4, HEADS) is None  # P TP=4 -> D TP=2: every head has an owner
    assert layout_refusal(pb.KVDestination(transfer_id="t", model_fingerprint=FP), FP, 2, HEADS) is None  # one-rank D, no TP fields

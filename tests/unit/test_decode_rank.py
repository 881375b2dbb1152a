"""A tensor-parallel decode worker's follower rank (decode_worker/ranks.py `DecodeRank`), driven as rank 0
drives it: `expect` is answered once the rank's receiver expects the pieces (rank 0 sends its admission
only then), `received` once they landed, `cancel` before `received` forgets the transfer."""

from __future__ import annotations

import dataclasses
import queue
from types import SimpleNamespace

import pytest
import torch

from common.config import KVTransferConfig
from common.engine_config import EngineConfig
from decode_worker.ranks import DecodeRank
from engine.kv_cache import KVCache
from engine.parallel.messages import Call
from kvtransfer import KVSender
from kvtransfer.pieces import Destination, PieceSend, RankSettings
from tests.unit.test_kvtransfer_pieces import DST_BLOCKS, FP, GLOBAL, HEADS, SRC_BLOCKS, N, source

pytestmark = pytest.mark.timeout(60)
TP = 2


def make_rank(index: int) -> DecodeRank:
    layout = dataclasses.replace(GLOBAL, num_kv_heads=HEADS // TP)
    runtime = SimpleNamespace(layout=layout, kv_cache=KVCache(layout, num_blocks=12))
    settings = RankSettings(KVTransferConfig(transport="tcp"), b"")
    return DecodeRank(runtime, index, EngineConfig(model="smollm2-135m", tensor_parallel_size=TP), settings)


@pytest.fixture
def ranks():
    made = [make_rank(index) for index in range(TP)]
    yield made
    for rank in made:
        rank.close()


@pytest.fixture
def rank(ranks):
    return ranks[1]


def ask(rank: DecodeRank, verb: str, transfer_id: str, payload=None) -> queue.Queue:
    answers: queue.Queue = queue.Queue()
    rank.handle(Call((verb, transfer_id), payload), answers.put)
    return answers


def expect(rank: DecodeRank, transfer_id: str) -> tuple:
    return ask(rank, "expect", transfer_id, (DST_BLOCKS, N, FP, 10.0)).get(timeout=10)


def test_expect_is_answered_once_the_receiver_expects_the_pieces_then_received_once_they_landed(ranks):
    for rank in ranks:
        assert expect(rank, "t") == ("ok", 0)
        assert rank.receiver.pending == 1  # a piece sent now is taken, not refused as unknown
    received = [ask(rank, "received", "t") for rank in ranks]
    with KVSender(ack_timeout=10.0) as sender:
        destination = Destination("t", FP, [rank.receiver.endpoint for rank in ranks], HEADS)
        send = PieceSend(sender, destination, GLOBAL, N, 0, 1)
        src = source()
        for layer in range(GLOBAL.num_layers):
            send.send_layer(layer, *src.read_tokens(layer, SRC_BLOCKS, N))
        send.finish(first_token=42)
        outcomes = [answers.get(timeout=10) for answers in received]
    assert outcomes == [("ok", 2 * GLOBAL.num_layers * N * (HEADS // TP) * 8 * 4)] * TP
    for rank in ranks:
        assert rank.receiver.pending == 0
        heads = rank.receiver.heads
        for layer in range(GLOBAL.num_layers):
            want_k, want_v = src.read_tokens(layer, SRC_BLOCKS, N)
            got_k, got_v = rank.receiver.cache.read_tokens(layer, DST_BLOCKS, N)
            assert torch.equal(got_k, want_k[:, heads.first:heads.end]) and torch.equal(got_v, want_v[:, heads.first:heads.end])


def test_cancel_before_received_forgets_the_transfer(rank):
    assert expect(rank, "c") == ("ok", 0)
    rank.handle(Call(("cancel", "c"), "client gone"), lambda _: pytest.fail("cancel is not answered"))
    verb, _, message = ask(rank, "received", "c").get(timeout=10)
    assert verb == "error" and "never expected" in message
    assert rank.receiver.pending == 0


def test_cancel_after_received_answers_it_with_the_failure(rank):
    assert expect(rank, "x") == ("ok", 0)
    received = ask(rank, "received", "x")
    rank.handle(Call(("cancel", "x"), "prefill failed"), lambda _: pytest.fail("cancel is not answered"))
    verb, _, message = received.get(timeout=10)
    assert verb == "error" and "prefill failed" in message
    assert rank.receiver.pending == 0


def test_a_second_expect_of_the_same_transfer_is_refused(rank):
    assert expect(rank, "d") == ("ok", 0)
    verb, _, message = expect(rank, "d")
    assert verb == "error" and "cannot expect d" in message
    received = ask(rank, "received", "d")
    rank.handle(Call(("cancel", "d"), "done"), lambda _: pytest.fail("cancel is not answered"))
    assert received.get(timeout=10)[0] == "error"
    assert rank.receiver.pending == 0

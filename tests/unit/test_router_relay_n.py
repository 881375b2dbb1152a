"""The relay of a decode stream with n sequences: chunks and finish messages are demultiplexed by
`index` (one detokenizer each), a sequence ended on a stop string drops D's later tokens, the relay
ends once every sequence has finished, and an error from D ends them all. A group restarted on
another decode worker replays: tokens already streamed are dropped (checked), finished sequences
stay finished, and a replay that diverges ends the request."""

from __future__ import annotations

import time

from common.sampling import SamplingParams
from proto.pdserve.v1 import pdserve_pb2 as pb
from router.detokenizer import IncrementalDetokenizer
from router.metrics import RouterMetrics
from router.progress import Progress, SequenceProgress
from router.relay import DecodeRelay, DecodeStream


class ScriptedCall:
    """A Decode call that answers the given messages, then EOF."""

    def __init__(self, messages: list[pb.DecodeResponse]):
        self.messages = list(messages)

    async def read(self):
        import grpc

        return self.messages.pop(0) if self.messages else grpc.aio.EOF

    def cancel(self) -> None:
        pass


class CharTokenizer:
    """Token id t is the character chr(t)."""

    def decode(self, ids, **_):
        return "".join(chr(t) for t in ids)

    def convert_ids_to_tokens(self, ids):
        return [chr(t) for t in ids]


def chunk(index: int, *tokens: str) -> pb.DecodeResponse:
    return pb.DecodeResponse(chunk=pb.TokenChunk(token_ids=[ord(t) for t in tokens], index=index))


def finished(index: int, reason=pb.FINISH_REASON_LENGTH, error: pb.Error | None = None, last: str = "") -> pb.DecodeResponse:
    """D's finish of sequence `index`, carrying the tokens of its last step (`last`)."""
    chunk = pb.TokenChunk(token_ids=[ord(t) for t in last], index=index)
    return pb.DecodeResponse(finished=pb.DecodeFinished(index=index, finish_reason=reason, error=error, chunk=chunk))


def group(n: int, stop: list[str] | None = None, tokenizer=None) -> Progress:
    now = time.monotonic()
    sequences = [SequenceProgress(i, IncrementalDetokenizer(tokenizer, [], stop or []) if tokenizer else None) for i in range(n)]
    return Progress("r", [1], SamplingParams(max_tokens=8, n=n), now, now + 60, sequences)


async def relay(state: Progress, messages: list[pb.DecodeResponse]) -> list[pb.GenerateResponse]:
    call = ScriptedCall(messages)
    out = [r async for r in DecodeRelay(0, RouterMetrics()).relay(DecodeStream(call), state, decoder=None)]
    assert not call.messages or state.all_finished
    return out


async def test_interleaved_sequences_are_demultiplexed_by_index():
    state = group(2)
    out = await relay(state, [chunk(0, "a"), chunk(1, "x"), chunk(1, "y"), finished(1), chunk(0, "b"), finished(0, pb.FINISH_REASON_STOP)])
    assert [(r.chunk.index, list(r.chunk.token_ids), r.finish_reason) for r in out] == [
        (0, [97], 0), (1, [120], 0), (1, [121], 0), (1, [], pb.FINISH_REASON_LENGTH), (0, [98], 0), (0, [], pb.FINISH_REASON_STOP)]
    assert [r.usage.completion_tokens for r in out if r.finish_reason] == [2, 2]
    assert [s.generated for s in state.sequences] == [[97, 98], [120, 121]]


async def test_a_stop_string_ends_one_sequence_and_drops_its_later_tokens():
    state = group(2, stop=["!"], tokenizer=CharTokenizer())
    out = await relay(state, [chunk(1, "h", "!"), chunk(1, "z"), chunk(0, "o", "k"), finished(1), finished(0)])
    finals = {r.chunk.index: r for r in out if r.finish_reason}
    assert finals[1].finish_reason == pb.FINISH_REASON_STOP and state.sequences[1].generated == [ord("h"), ord("!")]
    assert finals[0].finish_reason == pb.FINISH_REASON_LENGTH
    assert "".join(r.chunk.text for r in out if r.chunk.index == 0) == "ok"
    assert "".join(r.chunk.text for r in out if r.chunk.index == 1) == "h"


async def test_an_error_from_the_worker_ends_every_sequence():
    state = group(3)
    out = await relay(state, [chunk(2, "a"), finished(0, pb.FINISH_REASON_ERROR, pb.Error(code=pb.ERROR_CODE_INTERNAL, message="kv"))])
    assert out[-1].finish_reason == pb.FINISH_REASON_ERROR and out[-1].error.message == "kv"


async def test_a_restarted_group_drops_what_it_already_streamed():
    state = group(2)
    state.sequences[0].generated = [ord("a"), ord("b")]
    state.sequences[1].generated, state.sequences[1].finished = [ord("x")], True
    state.next_attempt()
    out = await relay(state, [chunk(0, "a"), chunk(1, "x"), chunk(0, "b", "c"), finished(1), chunk(0, "d"), finished(0)])
    assert [(r.chunk.index, list(r.chunk.token_ids), r.finish_reason) for r in out] == [
        (0, [ord("c")], 0), (0, [ord("d")], 0), (0, [], pb.FINISH_REASON_LENGTH)]
    assert state.sequences[0].generated == [ord(t) for t in "abcd"] and out[-1].usage.completion_tokens == 4


async def test_a_replay_that_diverges_ends_the_request():
    state = group(2)
    state.sequences[0].generated = [ord("a")]
    state.next_attempt()
    out = await relay(state, [chunk(0, "z")])
    assert out[-1].finish_reason == pb.FINISH_REASON_ERROR and "drew other tokens" in out[-1].error.message


async def test_a_finish_streams_the_tokens_it_carries_before_ending():
    state = group(1)
    out = await relay(state, [chunk(0, "a"), finished(0, pb.FINISH_REASON_STOP, last="b")])
    assert [(list(r.chunk.token_ids), r.finish_reason) for r in out] == [([97], 0), ([98], 0), ([], pb.FINISH_REASON_STOP)]
    assert state.sequences[0].generated == [97, 98] and out[-1].usage.completion_tokens == 2


async def test_a_stop_string_in_a_finishs_tokens_ends_the_sequence_once():
    state = group(1, stop=["!"], tokenizer=CharTokenizer())
    out = await relay(state, [chunk(0, "o"), finished(0, pb.FINISH_REASON_LENGTH, last="k!z")])
    assert [r.finish_reason for r in out] == [0, pb.FINISH_REASON_STOP]
    assert "".join(r.chunk.text for r in out) == "ok" and state.sequences[0].generated == [ord(t) for t in "ok!"]

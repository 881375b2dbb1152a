"""The router's stall check: a silent stream moves off its decode worker only once the pool has taken
that worker out of rotation (hung or paused), never while it still heartbeats (merely slow)."""

from __future__ import annotations

import asyncio
import dataclasses
import time

import pytest

from common.sampling import SamplingParams
from proto.pdserve.v1 import pdserve_pb2 as pb
from router.metrics import RouterMetrics
from router.progress import Progress, SequenceProgress
from router.relay import DecodeLost, DecodeRelay, DecodeStream

STALL_S = 0.2


class SilentCall:
    """A Decode call whose next message arrives after `delay_s` (never, if None)."""

    def __init__(self, delay_s: float | None):
        self.delay_s = delay_s
        self.cancelled = False

    async def read(self):
        if self.delay_s is None:
            await asyncio.Event().wait()
        await asyncio.sleep(self.delay_s)
        return pb.DecodeResponse(chunk=pb.TokenChunk(token_ids=[7]))

    def cancel(self) -> None:
        self.cancelled = True


def service() -> DecodeRelay:
    return DecodeRelay(STALL_S, metrics=RouterMetrics())


def streaming_state() -> Progress:
    state = Progress("r", [1, 2], SamplingParams(max_tokens=8), time.monotonic(), time.monotonic() + 60, [SequenceProgress(0, None)])
    state.last_token_at = time.monotonic()  # tokens already flow
    return state


@dataclasses.dataclass
class FakeWorker:
    healthy: bool


async def test_slow_but_healthy_worker_is_waited_for():
    router, worker = service(), FakeWorker(healthy=True)
    message = await router.next_message(DecodeStream(SilentCall(delay_s=4 * STALL_S)), streaming_state(), worker)
    assert list(message.chunk.token_ids) == [7]
    assert router.metrics.stalls._value.get() == 0


async def test_silent_stream_of_a_worker_out_of_rotation_is_lost():
    router, worker = service(), FakeWorker(healthy=True)
    call = SilentCall(delay_s=None)

    async def take_out_of_rotation() -> None:
        await asyncio.sleep(1.5 * STALL_S)
        worker.healthy = False

    asyncio.get_running_loop().create_task(take_out_of_rotation())
    with pytest.raises(DecodeLost, match="out of rotation"):
        await router.next_message(DecodeStream(call), streaming_state(), worker)
    assert router.metrics.stalls._value.get() == 1


async def test_no_stall_check_before_the_first_token():
    router, worker = service(), FakeWorker(healthy=False)
    state = streaming_state()
    state.last_token_at = None  # waiting for the prefill: the deadline, not the stall check, bounds it
    message = await router.next_message(DecodeStream(SilentCall(delay_s=2 * STALL_S)), state, worker)
    assert list(message.chunk.token_ids) == [7]

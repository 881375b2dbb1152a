"""Relay of one decode worker's `Decode` stream to the client, as `GenerateResponse`s.

`DecodeRelay.relay` reads D's messages one by one (`DecodeStream`), records TTFT / ITL / tokens,
detokenizes (a stop string ends the sequence), and shapes each sequence's last message from D's
`finished` (which carries the tokens of the step that finished it, so a D lost between two messages
never leaves a stop token streamed without its finish). With n > 1, D's chunks and finish messages
name their sequence (`index`): each has its own detokenizer; a sequence the router ended on a stop
string drops what D still sends for it, and the relay ends (cancelling D's call, which frees the
group) once every sequence has finished.
When D goes away mid-stream (the call fails, ends without finishing, or stays silent while the pool
has taken D out of rotation) it raises `DecodeLost`, and the orchestrator migrates the request.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import grpc

from proto.pdserve.v1 import pdserve_pb2 as pb
from router.metrics import RouterMetrics
from router.pool import Worker
from router.progress import Progress, ReplayDiverged, SequenceProgress

LOST_CODES = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL, grpc.StatusCode.CANCELLED)


class DecodeLost(Exception):
    """The decode worker went away mid-stream; the request can migrate."""


class DecodeStream:
    """One `Decode` call read message by message (gRPC forbids mixing `read()` and `async for`
    on one call); a message read ahead can be pushed back."""

    def __init__(self, call):
        self._call = call
        self._pushed: list = []

    async def read(self):
        if self._pushed:
            return self._pushed.pop()
        message = await self._call.read()
        return None if message is grpc.aio.EOF else message

    def push_back(self, message) -> None:
        self._pushed.append(message)

    def cancel(self) -> None:
        self._call.cancel()


class DecodeRelay:
    def __init__(self, stall_timeout_s: float, metrics: RouterMetrics):
        self.stall_timeout_s, self.metrics = stall_timeout_s, metrics

    async def relay(self, call: DecodeStream, state: Progress, decoder: Worker) -> AsyncIterator[pb.GenerateResponse]:
        """Forward one decode worker's stream; raises DecodeLost if the worker goes away mid-stream."""
        try:
            while (message := await self.next_message(call, state, decoder)) is not None:
                event = message.WhichOneof("event")
                if event not in ("chunk", "finished"):
                    continue
                fin = message.finished if event == "finished" else None
                if fin is not None and fin.HasField("error"):
                    yield self._on_finished(state, state.sequences[0], fin)  # a failed call ends every sequence
                    return
                index = message.chunk.index if fin is None else fin.index
                if index >= len(state.sequences) or state.sequences[index].finished:
                    continue  # ended here on a stop string: D's later tokens for it are dropped
                seq = state.sequences[index]
                try:
                    responses = self._on_message(state, seq, message.chunk if fin is None else fin.chunk, fin)
                except ReplayDiverged as exc:
                    yield pb.GenerateResponse(request_id=state.request_id, finish_reason=pb.FINISH_REASON_ERROR,
                                              error=pb.Error(code=pb.ERROR_CODE_UNAVAILABLE, message=str(exc)))
                    return
                for response in responses:
                    yield response
                if state.all_finished:
                    return
        except grpc.aio.AioRpcError as exc:
            if exc.code() in LOST_CODES:
                raise DecodeLost(f"{exc.code().name}: {exc.details()}") from None
            raise
        raise DecodeLost("decode stream ended without finishing")

    async def next_message(self, call: DecodeStream, state: Progress, decoder: Worker) -> pb.DecodeResponse | None:
        """D's next message. A stream silent for `stall_timeout_s` after its first token is moved off D
        (DecodeLost) if the pool took D out of rotation meanwhile (missed heartbeats: hung or paused);
        a D that still heartbeats is only slow (a preempted request waits for blocks) and is waited for.
        Near the client's deadline the call's own deadline decides."""
        stall = self.stall_timeout_s
        if not stall or state.last_token_at is None:
            return await call.read()
        read = asyncio.ensure_future(call.read())  # never cancelled while waiting: that would cancel the call
        try:
            while not (await asyncio.wait({read}, timeout=stall))[0]:
                if not decoder.healthy:
                    read.cancel()
                    self.metrics.stalls.inc()
                    raise DecodeLost(f"no token for {stall:g} s and the worker is out of rotation (hung or paused)")
        except asyncio.CancelledError:
            read.cancel()
            raise
        return read.result()

    def _on_message(self, state: Progress, seq: SequenceProgress, worker_chunk: pb.TokenChunk,
                    fin: pb.DecodeFinished | None) -> list[pb.GenerateResponse]:
        """The client's messages for D's chunk and, when `fin`, the sequence's finish (its last tokens
        come in `fin.chunk`; a stop string among them ends the sequence before D's finish)."""
        responses = [self._on_chunk(state, seq, worker_chunk)] if worker_chunk.token_ids else []
        if fin is not None and not seq.finished:
            responses.append(self._on_finished(state, seq, fin))
        return [response for response in responses if response is not None]

    def _on_chunk(self, state: Progress, seq: SequenceProgress, worker_chunk: pb.TokenChunk) -> pb.GenerateResponse | None:
        """The chunk for the client; None when it only replayed tokens already streamed (restarted group)."""
        skip = seq.replay(list(worker_chunk.token_ids))
        if skip == len(worker_chunk.token_ids):
            return None
        now = time.monotonic()
        if state.last_token_at is None:
            state.timings.ttft_s = now - state.arrived
            self.metrics.ttft.observe(state.timings.ttft_s)
        elif seq.last_token_at is not None:
            self.metrics.itl.observe(now - seq.last_token_at)
        state.last_token_at = seq.last_token_at = now
        chunk = pb.TokenChunk(token_ids=worker_chunk.token_ids[skip:], logprobs=worker_chunk.logprobs[skip:], index=seq.index)
        step = seq.detok.add(list(chunk.token_ids)) if seq.detok is not None else None
        if step is not None and step.stopped:  # a chunk of several tokens (speculative decoding) ends at the stop
            del chunk.token_ids[step.num_tokens:]
            del chunk.logprobs[step.num_tokens:]
        seq.add(list(chunk.token_ids))
        self.metrics.tokens.inc(len(chunk.token_ids))
        if step is not None:
            chunk.text = step.text
            if step.stopped:
                return state.final(chunk, pb.FINISH_REASON_STOP, self.metrics, seq)
        return pb.GenerateResponse(request_id=state.request_id, chunk=chunk)

    def _on_finished(self, state: Progress, seq: SequenceProgress, fin: pb.DecodeFinished) -> pb.GenerateResponse:
        if fin.timings.local_prefill:  # else the prefill worker's answer said its stages and what it did not compute
            state.worker_stages(fin.timings)
            state.cached_prompt_tokens = max(state.cached_prompt_tokens, fin.usage.cached_prompt_tokens)
        tail = pb.TokenChunk(text=seq.detok.finish().text) if seq.detok is not None else pb.TokenChunk()
        response = state.final(tail, fin.finish_reason or pb.FINISH_REASON_STOP, self.metrics, seq)
        if fin.HasField("error"):
            response.error.CopyFrom(fin.error)
        return response

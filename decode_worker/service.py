"""DecodeWorker gRPC service: admit, receive KV, decode with continuous batching, stream tokens.

Life of one `Decode` call (remote prefill):
  1. validate and reserve KV blocks for the prompt (`reserve_remote_kv`): the prompt's leading blocks
     that this worker's prefix cache holds (a conversation's earlier turns) are reused as they are;
     when the pool is full the call waits for blocks up to `admission_timeout_s`, then fails
     RESOURCE_EXHAUSTED (backpressure);
  2. register the transfer of the rest with the KV receiver and answer with `KVAdmission` (endpoint,
     transfer id, `held_tokens`: the prefill worker sends only the KV after them);
  3. wait for the KV; a bad or missing transfer aborts the request, frees its blocks and ends the
     stream with a `DecodeFinished` carrying the KV error code;
  4. commit the KV with the first token the trailer carried (and its logprobs): the engine emits that
     token as the first output of the request's stream and the request becomes RUNNING; stream
     chunks from the engine's continuous-batching loop until it finishes.
With `n` > 1 the one received prompt is forked into n sequences by the engine (sequence 0 starts from
the trailer's first token); chunks and one `DecodeFinished` per sequence carry its index.
With `local_prefill` the worker prefills the prompt itself (conditional disaggregation).
Timings (`StageTimings` on each `DecodeFinished`, this process's clock): the wait for blocks
(`decode_admission_s`) and for the KV (`kv_transfer_s`); with local prefill the prompt's queue and
compute (`prefill_queue_s`, `prefill_compute_s`), which the router carries into the critical path.
A cancelled call (router gone, deadline) aborts the request on the engine and the receiver.
A `FaultPoint` (tests only, given by the worker's main) may stall the process at a named point.
Tracing: the call is the span `decode` (under the router's `generate`, from the call's metadata); the
wait for the KV, from the admission to its verification, is its child `kv.receive` (docs/observability.md).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from collections.abc import AsyncIterator

import grpc
from opentelemetry.trace import Span, SpanKind

from common.errors import InvalidRequestError
from common.serving import CallGate
from common.tracing import annotate, context_of, fail, server_span, span
from decode_worker.ranks import FollowerReceivers
from engine.async_engine import AsyncEngine
from engine.messages import chunk_from_output, prefill_timings, worker_stats
from engine.outputs import RemoteReservation
from engine.sampler import Sample
from kvtransfer import KVEndpoint, KVReceiver, KVTransferError
from kvtransfer.faults import FaultPoint, reached
from kvtransfer.prefix import PrefixSource
from proto.convert import finish_reason_to_proto, sampling_or_abort
from proto.pdserve.v1 import pdserve_pb2 as pb
from proto.pdserve.v1 import pdserve_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)


class DecodeService(pb_grpc.DecodeWorkerServicer):
    def __init__(
        self,
        engine: AsyncEngine,
        receiver: KVReceiver,
        fingerprint: str,
        worker_id: str,
        kv_timeout_s: float = 30.0,
        admission_timeout_s: float = 30.0,
        fault_point: FaultPoint | None = None,
        followers: FollowerReceivers | None = None,
        follower_endpoints: list[KVEndpoint] | None = None,
        source: PrefixSource | None = None,
    ):
        """`followers`: a tensor-parallel worker's other ranks and their receivers' endpoints (rank order).
        `fault_point`: test hook (stall or mark at a named point), None in production."""
        self.engine = engine
        self.receiver = receiver
        self.followers = followers or FollowerReceivers(None)
        self.rank_endpoints = [receiver.endpoint, *(follower_endpoints or [])]
        self.kv_bytes_received = 0
        """KV bytes every rank received in complete transfers."""
        self.fingerprint = fingerprint
        self.worker_id = worker_id
        self.kv_timeout_s = kv_timeout_s
        self.admission_timeout_s = admission_timeout_s
        self.fault_point = fault_point
        self.gate = CallGate("decode")
        self.source = source
        """Answers `SendPrefix`: a prefill worker pulls a prefix this worker holds (kvtransfer.prefix)."""

    async def Decode(self, request: pb.DecodeRequest, context: grpc.aio.ServicerContext) -> AsyncIterator[pb.DecodeResponse]:
        request_id = request.request_id or uuid.uuid4().hex
        with server_span("decode", context, request_id=request_id, worker_id=self.worker_id, prompt_tokens=len(request.token_ids),
                         local_prefill=request.local_prefill, priority=request.priority) as call_span:
            params = await sampling_or_abort(request.sampling, context)
            await self.gate.enter(context)
            try:
                if request.local_prefill:
                    generated = self.engine.generate(request_id, list(request.token_ids), params, priority=request.priority,
                                                     reuse_cached=not request.recompute)
                    responses = self._stream(request_id, generated, time.monotonic(), context, pb.StageTimings(local_prefill=True))
                else:
                    responses = self._remote(request_id, request, params, context, call_span)
                async for response in responses:
                    if response.HasField("finished"):
                        _record_finish(call_span, response.finished)
                    yield response
            finally:
                self.gate.leave()

    async def _remote(self, request_id, request, params, context, call_span: Span) -> AsyncIterator[pb.DecodeResponse]:
        started = time.monotonic()
        prompt = list(request.token_ids)
        try:
            reserved = await self._reserve(request_id, prompt, params, request.priority, context)
        except asyncio.CancelledError:  # the reservation may land after the cancel: undo it
            await self.engine.abort(request_id)
            raise
        admitted = time.monotonic()
        stream = self.engine.open_stream(request_id, params.n)
        transfer_id = f"{request_id}-{uuid.uuid4().hex[:8]}"
        timeout = request.kv_timeout_s or self.kv_timeout_s
        expected: asyncio.Future | None = None
        committed = False
        try:
            incoming = reserved.incoming_block_ids
            expected = await self._expect(transfer_id, incoming, len(prompt) - reserved.held_tokens, timeout)
            yield pb.DecodeResponse(
                request_id=request_id,
                admission=pb.KVAdmission(
                    kv_destination=self._destination(transfer_id, reserved.held_tokens),
                    num_prompt_tokens=len(prompt),
                    num_blocks=len(reserved.block_ids),
                    cached_prompt_tokens=reserved.held_tokens,
                    admission_wait_s=admitted - started,
                    kv_blocks_reused=reserved.held_blocks,
                    kv_blocks_moved=reserved.moved_blocks,
                ),
            )
            reached(self.fault_point, "decode.before_transfer", request_id)
            try:
                with span("kv.receive", context_of(call_span), SpanKind.CONSUMER, transfer_id=transfer_id, transport=self.receiver.endpoint.transport,
                          kv_blocks=len(incoming), kv_blocks_held=reserved.held_blocks) as kv_span:
                    received = await asyncio.shield(expected)  # a cancelled call must not cancel the transfer itself
                    self.kv_bytes_received += received.nbytes
                    annotate(kv_span, kv_bytes=received.nbytes, kv_wait_s=received.wait_s, kv_transfer_s=received.transfer_s)
            except KVTransferError as exc:
                log.warning("request %s: KV transfer failed: %s", request_id, exc)
                yield _finished(request_id, pb.FINISH_REASON_ERROR, _kv_error(exc))
                return
            kv_done = time.monotonic()
            first = Sample(received.first_token, received.first_logprob, received.first_top_logprobs)
            self.engine.commit_remote_kv(request_id, first)  # the stream's first output, at once
            committed = True
            reached(self.fault_point, "decode.after_transfer", request_id)
            timings = pb.StageTimings(decode_admission_s=admitted - started, kv_transfer_s=kv_done - admitted)
            outputs = self.engine.generate_remote(request_id, stream)
            async for response in self._stream(request_id, outputs, started, context, timings):
                yield response
        finally:
            if not committed:
                self._give_up(request_id, transfer_id)
                await asyncio.shield(self._abort_when_settled(request_id, expected))

    async def _expect(self, transfer_id: str, blocks: list[int], num_tokens: int, timeout: float) -> asyncio.Future:
        """Every rank's pieces of the prompt's KV, expected by every rank when this returns (the admission may
        go out: a prefill worker sends as soon as it has it): the future of rank 0's `ReceivedKV` (its trailer
        has the first token), resolved once the other ranks have theirs too."""
        own = self.receiver.expect_pieces(transfer_id, blocks, num_tokens, self.fingerprint, timeout=timeout)
        if self.followers.group is None:
            return own
        try:
            await self.followers.expect(transfer_id, blocks, num_tokens, self.fingerprint, timeout)
        except KVTransferError as exc:  # before any admission: nothing can write into the blocks, fail at once
            self.receiver.cancel(transfer_id, f"a follower rank cannot expect its pieces: {exc}")
            self.followers.cancel(transfer_id, "another rank cannot expect its pieces")
        theirs = asyncio.ensure_future(self.followers.received(transfer_id))

        async def every_rank():
            try:
                received = await asyncio.shield(own)
            except BaseException:
                self.followers.cancel(transfer_id, "rank 0's pieces failed")
                await asyncio.wait([theirs])
                raise
            followers_bytes = await asyncio.shield(theirs)  # a follower's failure fails the request
            return dataclasses.replace(received, nbytes=received.nbytes + followers_bytes)

        return asyncio.ensure_future(every_rank())

    def _destination(self, transfer_id: str, held_tokens: int) -> pb.KVDestination:
        endpoints = [pb.KVEndpoint(host=e.host, port=e.port, transport=e.transport) for e in self.rank_endpoints]
        return pb.KVDestination(endpoint=endpoints[0], transfer_id=transfer_id, model_fingerprint=self.fingerprint,
                                rank_endpoints=endpoints, num_kv_heads=self.engine.global_layout.num_kv_heads, held_tokens=held_tokens)

    def _give_up(self, request_id: str, transfer_id: str) -> None:
        """A request whose KV never committed: its stream closes and its transfer is cancelled on every rank at once."""
        self.engine.close_stream(request_id)
        self.receiver.cancel(transfer_id)
        self.followers.cancel(transfer_id)

    async def _abort_when_settled(self, request_id: str, expected: asyncio.Future | None) -> None:
        """Free the request's blocks once no write into them can still land (on any rank); at once when no
        rank was asked to expect any (`expected` None)."""
        if expected is not None:
            await asyncio.wait([expected], timeout=self.receiver.settle_timeout + 1)
            if expected.done() and not expected.cancelled():
                expected.exception()  # retrieved: the outcome was logged where it happened
        await self.engine.abort(request_id)

    async def _reserve(self, request_id, prompt, params, priority, context) -> RemoteReservation:
        deadline = time.monotonic() + self.admission_timeout_s
        while True:
            try:
                reserved = await self.engine.reserve_remote_kv(request_id, prompt, params, priority)
            except InvalidRequestError as exc:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            if reserved is not None:
                return reserved
            if time.monotonic() > deadline:
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "no free KV blocks on this decode worker")
            await asyncio.sleep(0.02)

    async def _stream(self, request_id, outputs, started, context, timings: pb.StageTimings) -> AsyncIterator[pb.DecodeResponse]:
        """Engine outputs -> chunks, then one finish message per sequence carrying its last step's tokens
        (its usage counts its tokens and `timings` what this worker measured: with local prefill, the
        prompt's queue and compute)."""
        usages: dict[int, pb.Usage] = {}
        try:
            async for out in outputs:
                if timings.local_prefill and not timings.prefill_compute_s and out.new_token_ids:
                    timings.MergeFrom(prefill_timings(started, out, time.monotonic()))
                usage = usages.setdefault(out.index, pb.Usage())
                usage.prompt_tokens = out.num_prompt_tokens or usage.prompt_tokens
                usage.cached_prompt_tokens = max(usage.cached_prompt_tokens, out.num_cached_tokens)
                usage.completion_tokens += len(out.new_token_ids)
                if out.finished:  # the step's tokens travel with the finish (DecodeFinished.chunk)
                    timings.e2e_s = time.monotonic() - started
                    finished = pb.DecodeFinished(finish_reason=finish_reason_to_proto(out.finish_reason), usage=usage, timings=timings,
                                                 index=out.index, chunk=chunk_from_output(out))
                    yield pb.DecodeResponse(request_id=request_id, finished=finished)
                elif out.new_token_ids:
                    yield pb.DecodeResponse(request_id=request_id, chunk=chunk_from_output(out))
                    reached(self.fault_point, "decode.after_tokens", request_id, usage.completion_tokens)
        except InvalidRequestError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))

    async def SendPrefix(self, request: pb.SendPrefixRequest, context: grpc.aio.ServicerContext) -> pb.SendPrefixResponse:
        if self.source is None:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "this worker sends no prefixes")
        return await self.source.send(request, context)

    async def Stats(self, request: pb.StatsRequest, context) -> pb.WorkerStats:
        return await worker_stats(self.engine, self.worker_id, pb.ROLE_DECODE, self.gate.draining, request,
                                  kv_bytes_received=self.kv_bytes_received, kv_bytes_sent=self.source.sent_bytes if self.source is not None else 0)

    # ---- drain ---------------------------------------------------------------------------------
    async def drain(self, grace_s: float) -> None:
        await self.gate.drain()


def _record_finish(call_span: Span, finished: pb.DecodeFinished) -> None:
    annotate(call_span, completion_tokens=finished.usage.completion_tokens, finish_reason=pb.FinishReason.Name(finished.finish_reason))
    if finished.HasField("error"):
        fail(call_span, finished.error.message)


def _finished(request_id: str, reason: int, error: pb.Error | None = None) -> pb.DecodeResponse:
    return pb.DecodeResponse(request_id=request_id, finished=pb.DecodeFinished(finish_reason=reason, error=error))


def _kv_error(exc: KVTransferError) -> pb.Error:
    code = pb.ErrorCode.Value(f"ERROR_CODE_KV_{exc.code.name}") if f"ERROR_CODE_KV_{exc.code.name}" in pb.ErrorCode.keys() else pb.ERROR_CODE_INTERNAL
    return pb.Error(code=code, message=str(exc))


"""PrefillWorker gRPC service: run prompts in prefill-only mode and ship their KV to a decode worker.

Life of one `Prefill` call:
  1. validate; begin this worker's pieces of the prompt's KV (kvtransfer.pieces.PieceSend): one
     transfer per decode rank sharing heads with ours (TP = 1 on both sides: one transfer of every
     head), over a reused connection (header: transfer id, model fingerprint, token count, layout,
     head range); a tensor-parallel worker's follower ranks begin theirs (prefill_worker.ranks);
  2. add the prompt to the engine as prefill-only; it is batched with other prompts (chunked
     prefill, prefix cache). During the step that completes the prompt, the engine hands every
     finished layer's K/V of the prompt to its `KVLayerSink`, the `LayerStreamer` below, which
     queues it on the transfer, so layer i travels while layer i+1 computes (layer-wise streaming;
     without a streamer: all layers after the step);
  3. the step samples the first token; the trailers (first token, its logprobs when asked, checksum)
     close the transfers and every decode rank's acknowledgement comes back (the followers' too);
  4. the first token is returned; the request's blocks are released (they stay in the prefix cache)
     meanwhile, on the engine's thread between two steps, so that the answer does not wait for a step.
The answer's `StageTimings` splits the call's time here: prefill_queue (call received -> the
prompt's first engine step), prefill_compute (-> first token sampled), kv_transfer (-> every decode
rank acknowledged: the transfer time exposed after the forward).
Any failure aborts the transfer (the receiver frees its blocks) and fails the call.
Tracing: the call is the span `prefill` (under the router's `prefill`, from the call's metadata) and
the transfer, from begin to D's acknowledgement, its child `kv.send` (docs/observability.md).
A `FaultPoint` (tests only, given by the worker's main) may stall the process at a named point.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid

import grpc
from opentelemetry.trace import Span, SpanKind

from common.errors import InvalidRequestError
from common.serving import CallGate
from common.tracing import annotate, context_of, fail, server_span, start_span
from engine.async_engine import AsyncEngine
from engine.messages import chunk_from_output, prefill_timings, worker_stats
from engine.outputs import RequestOutput
from kvtransfer import KVEndpoint, KVSender, KVTransferError
from kvtransfer.faults import FaultPoint, reached
from kvtransfer.pieces import Destination, PieceSend
from kvtransfer.prefix import PrefixPuller, PrefixSource, PullStats
from kvtransfer.sharding import IncompatibleLayouts, check_compatible
from prefill_worker.ranks import FollowerSends
from prefill_worker.streamer import LayerStreamer
from proto.convert import sampling_or_abort
from proto.pdserve.v1 import pdserve_pb2 as pb
from proto.pdserve.v1 import pdserve_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)


class PrefillService(pb_grpc.PrefillWorkerServicer):
    def __init__(self, engine: AsyncEngine, sender: KVSender, fingerprint: str, worker_id: str,
                 streamer: LayerStreamer | None = None, ack_timeout_s: float = 30.0, fault_point: FaultPoint | None = None,
                 puller: PrefixPuller | None = None, source: PrefixSource | None = None):
        """`streamer`: the sink the engine was built with (layer-wise streaming); None: every layer
        is sent after the prompt's step. `fault_point`: test hook, None in production. `puller`: pulls
        a prompt's prefix from the worker the router names (None: never); `source`: answers `SendPrefix`."""
        self.puller, self.source = puller, source
        self.engine = engine
        self.sender = sender
        self.fingerprint = fingerprint
        self.worker_id = worker_id
        self.streamer = streamer
        self.ack_timeout_s = ack_timeout_s
        self.fault_point = fault_point
        self.followers = FollowerSends(engine.ranks)
        self.kv_bytes_sent = 0
        """KV bytes every rank delivered (acknowledged transfers)."""
        self.gate = CallGate("prefill")
        self._releases: set[asyncio.Task] = set()
        """Releases of finished prompts still in flight: the answer does not wait for the engine's next step."""

    async def Prefill(self, request: pb.PrefillRequest, context: grpc.aio.ServicerContext) -> pb.PrefillResponse:
        request_id = request.request_id or uuid.uuid4().hex
        with server_span("prefill", context, request_id=request_id, worker_id=self.worker_id, prompt_tokens=len(request.token_ids),
                         priority=request.priority) as call_span:
            response = await self._prefill(request_id, request, context, call_span)
            annotate(call_span, cached_prompt_tokens=response.cached_prompt_tokens, kv_bytes=response.kv_bytes_sent)
            return response

    async def _prefill(self, request_id: str, request: pb.PrefillRequest, context: grpc.aio.ServicerContext,
                       call_span: Span) -> pb.PrefillResponse:
        received = time.monotonic()
        params = await sampling_or_abort(request.sampling, context)
        dest = request.kv_destination if request.HasField("kv_destination") else None
        refusal = dest is not None and layout_refusal(dest, self.fingerprint, self.engine.tensor_parallel_size,
                                                      self.engine.global_layout.num_kv_heads)
        if refusal:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, refusal)
        if dest is not None and (dest.held_tokens % self.engine.layout.block_size or dest.held_tokens >= len(request.token_ids)):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"kv_destination.held_tokens: {dest.held_tokens} is not a whole number of "
                                f"{self.engine.layout.block_size}-token blocks below the prompt's {len(request.token_ids)} tokens")
        await self.gate.enter(context)
        transfer = kv_span = None
        try:
            timeout = request.kv_ack_timeout_s or self.ack_timeout_s
            if dest is not None:
                transfer = self._begin(request_id, dest, len(request.token_ids), timeout)
                kv_span = start_span("kv.send", context_of(call_span), SpanKind.PRODUCER, transfer_id=dest.transfer_id,
                                     transport=dest.endpoint.transport, destination=f"{dest.endpoint.host}:{dest.endpoint.port}",
                                     decode_ranks=len(dest.rank_endpoints) or 1)
            pulled = 0
            if self.puller is not None and request.HasField("kv_source"):
                pulled = await self.puller.pull(request_id, list(request.token_ids), request.kv_source)
            first, first_out = await self._run_prefill(request_id, list(request.token_ids), params, request.priority, context)
            computed = time.monotonic()
            call_span.add_event("first token sampled")
            if transfer is not None:
                await self._finish_transfer(request_id, transfer, first_out)
                # every rank's trailers go out before any ack is awaited: a decode rank acknowledges its
                # pieces together, so rank 0's ack may wait for a follower's trailer
                sent = sum(await asyncio.gather(transfer.wait(timeout), self.followers.finish(request_id)))
                self.kv_bytes_sent += sent
                annotate(kv_span, kv_bytes=sent, kv_layers=self.engine.global_layout.num_layers)
                reached(self.fault_point, "prefill.after_transfer", request_id)
            done = time.monotonic()
            return pb.PrefillResponse(
                request_id=request_id,
                first_token=_first_token(first, first_out),
                prompt_tokens=len(request.token_ids),
                cached_prompt_tokens=first_out.num_cached_tokens,
                kv_bytes_sent=sent if transfer is not None else 0,
                pulled_prompt_tokens=pulled,
                timings=prefill_timings(received, first_out, computed, kv_transfer_s=done - computed),
            )
        except KVTransferError as exc:
            log.warning("request %s: KV transfer failed: %s", request_id, exc)
            if kv_span is not None:
                fail(kv_span, exc)
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"kv transfer failed ({exc.code.name}): {exc}")
        finally:
            self.gate.leave()
            if self.streamer is not None:
                self.streamer.forget(request_id)
            if transfer is not None and not transfer.done:
                transfer.abort("prefill failed or was cancelled")
            if transfer is not None:
                self.followers.abort(request_id, "prefill failed or was cancelled")
            if kv_span is not None:
                kv_span.end()
            release = asyncio.ensure_future(self.engine.release(request_id))
            self._releases.add(release)
            release.add_done_callback(self._releases.discard)

    def _begin(self, request_id: str, dest: pb.KVDestination, num_tokens: int, timeout: float) -> PieceSend:
        """Open this worker's pieces of the prompt's KV (rank 0's here, the followers' on their ranks)."""
        layout = self.engine.global_layout
        endpoints = [KVEndpoint(e.host, e.port, e.transport) for e in dest.rank_endpoints or [dest.endpoint]]
        destination = Destination(dest.transfer_id, self.fingerprint, endpoints, dest.num_kv_heads or layout.num_kv_heads,
                                  dest.held_tokens)
        reached(self.fault_point, "prefill.before_transfer", request_id)
        transfer = PieceSend(self.sender, destination, layout, num_tokens, 0, self.engine.tensor_parallel_size, timeout)
        self.followers.begin(request_id, destination, num_tokens)
        if self.streamer is not None:
            self.streamer.track(request_id, transfer)
        return transfer

    async def _run_prefill(self, request_id, prompt, params, priority, context):
        try:
            async for out in self.engine.generate(request_id, prompt, params, prefill_only=True, priority=priority):
                if out.new_token_ids:
                    return out.new_token_ids[0], out
        except InvalidRequestError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        await context.abort(grpc.StatusCode.ABORTED, "prefill was aborted")

    async def _finish_transfer(self, request_id: str, transfer: PieceSend, first_out: RequestOutput) -> None:
        """Send what the streamer did not (without one: every layer, read by the engine in the prompt's own step), then
        the trailer with the first token."""
        if self.streamer is None:
            for layer, (k, v) in enumerate(first_out.prompt_kv):
                transfer.send_layer(layer, k[transfer.start:], v[transfer.start:])
        logprob = first_out.logprobs[0] if first_out.logprobs else None
        transfer.finish(first_out.new_token_ids[0], logprob, first_out.top_logprobs[0] if first_out.top_logprobs else None)

    async def SendPrefix(self, request: pb.SendPrefixRequest, context: grpc.aio.ServicerContext) -> pb.SendPrefixResponse:
        if self.source is None:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "this worker sends no prefixes")
        return await self.source.send(request, context)

    async def Stats(self, request: pb.StatsRequest, context) -> pb.WorkerStats:
        pulls = self.puller.stats if self.puller is not None else PullStats()
        return await worker_stats(self.engine, self.worker_id, pb.ROLE_PREFILL, self.gate.draining, request,
                                  kv_bytes_sent=self.kv_bytes_sent + (self.source.sent_bytes if self.source is not None else 0),
                                  kv_bytes_received=pulls.received_bytes, **pulls.worker_stats_fields())

    async def drain(self, grace_s: float) -> None:
        await self.gate.drain()
        if self._releases:
            await asyncio.wait(list(self._releases))


def layout_refusal(dest: pb.KVDestination, fingerprint: str, tp: int, num_kv_heads: int) -> str | None:
    """Why this worker (TP = tp over num_kv_heads KV heads) cannot fill `dest`, naming both sides, or
    None: checked before any byte moves, so a mismatch fails at once instead of hanging a transfer."""
    theirs = (len(dest.rank_endpoints) or 1, dest.num_kv_heads or num_kv_heads)
    sides = (f"decode worker TP={theirs[0]} with {theirs[1]} KV heads, "
             f"this prefill worker TP={tp} with {num_kv_heads} KV heads")
    if dest.model_fingerprint and dest.model_fingerprint != fingerprint:
        return f"kv_destination.model_fingerprint: the decode worker runs a different model or KV layout ({sides})"
    try:
        check_compatible((tp, num_kv_heads), theirs)
    except IncompatibleLayouts as exc:
        return f"kv_destination: {exc}"
    return None


def _first_token(token_id: int, out) -> pb.FirstToken:
    """The sampled first token, with its logprobs when the request asked for them."""
    first = pb.FirstToken(token_id=token_id)
    chunk = chunk_from_output(out)
    if chunk.logprobs:
        first.logprob.CopyFrom(chunk.logprobs[0])
    return first

"""PrefillWorker gRPC service: run prompts in prefill-only mode and ship their KV to a decode worker.

Life of one `Prefill` call:
  1. validate; open (or reuse) a connection to the destination's KV receiver and begin a transfer
     (header: transfer id, model fingerprint, token count, layout);
  2. add the prompt to the engine as prefill-only; it is batched with other prompts (chunked
     prefill, prefix cache). During the step that completes the prompt, the engine calls
     `on_layer_written` after every layer: that layer's K/V for the prompt is handed to the sender,
     so layer i travels while layer i+1 computes (layer-wise streaming; off: all layers after the step);
  3. the step samples the first token; the trailer (first token + checksum) closes the transfer and
     the decode worker's acknowledgement comes back;
  4. the request's blocks are released (they stay in the prefix cache) and the first token returned.
Any failure aborts the transfer (the receiver frees its blocks) and fails the call.
"""

from __future__ import annotations

import logging
import time
import uuid

import grpc

from common.serving import wait_idle
from engine.async_engine import AsyncEngine
from engine.errors import InvalidRequestError
from engine.sequence import Sequence
from kvtransfer import KVEndpoint, KVSender, KVTransferError, TransferHeader
from kvtransfer.faults import FaultPoint, reached
from proto.convert import chunk_from_output, sampling_from_proto, worker_stats
from proto.pdserve.v1 import pdserve_pb2 as pb
from proto.pdserve.v1 import pdserve_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

# Test hook (off unless PDSERVE_TEST_FAULT_POINT / PDSERVE_TEST_PAUSE_AFTER_LAYER is set): stall or mark
# this process before, during (after layer N) or after a request's KV transfer, so a test can kill it there.
_HOOK = FaultPoint.from_env()


class PrefillService(pb_grpc.PrefillWorkerServicer):
    def __init__(self, engine: AsyncEngine, sender: KVSender, fingerprint: str, worker_id: str, layerwise: bool = True,
                 ack_timeout_s: float = 30.0):
        self.engine = engine
        self.sender = sender
        self.fingerprint = fingerprint
        self.worker_id = worker_id
        self.layerwise = layerwise
        self.ack_timeout_s = ack_timeout_s
        self.draining = False
        self.in_flight = 0
        self._transfers: dict[str, object] = {}
        engine.engine.on_layer_written = self._on_layer_written if layerwise else None

    async def Prefill(self, request: pb.PrefillRequest, context: grpc.aio.ServicerContext) -> pb.PrefillResponse:
        if self.draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "prefill worker is draining")
        request_id = request.request_id or uuid.uuid4().hex
        try:
            params = sampling_from_proto(request.sampling)
        except InvalidRequestError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        dest = request.kv_destination if request.HasField("kv_destination") else None
        if dest is not None and dest.model_fingerprint and dest.model_fingerprint != self.fingerprint:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "kv_destination.model_fingerprint: decode worker runs a different model or KV layout")
        self.in_flight += 1
        received = time.monotonic()
        transfer = None
        try:
            if dest is not None:
                endpoint = KVEndpoint(dest.endpoint.host, dest.endpoint.port, dest.endpoint.transport)
                header = TransferHeader.for_layout(dest.transfer_id, self.engine.engine.layout, len(request.token_ids), self.fingerprint)
                reached(_HOOK, "prefill.before_transfer", request_id)
                transfer = self.sender.begin(endpoint, header, ack_timeout=request.kv_ack_timeout_s or self.ack_timeout_s)
                self._transfers[request_id] = transfer
            first, first_out = await self._run_prefill(request_id, list(request.token_ids), params, context)
            computed = time.monotonic()
            if transfer is not None:
                if not self.layerwise:
                    await self._send_all_layers(request_id, transfer)
                transfer.finish(first)
                ack = await transfer.wait(timeout=request.kv_ack_timeout_s or self.ack_timeout_s)
                reached(_HOOK, "prefill.after_transfer", request_id)
            done = time.monotonic()
            return pb.PrefillResponse(
                request_id=request_id,
                first_token=_first_token(first, first_out),
                prompt_tokens=len(request.token_ids),
                cached_prompt_tokens=first_out.num_cached_tokens,
                kv_bytes_sent=ack.nbytes if transfer is not None else 0,
                timings=pb.StageTimings(prefill_compute_s=computed - received, kv_transfer_s=done - computed),
            )
        except KVTransferError as exc:
            log.warning("request %s: KV transfer failed: %s", request_id, exc)
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"kv transfer failed ({exc.code.name}): {exc}")
        finally:
            self.in_flight -= 1
            self._transfers.pop(request_id, None)
            if transfer is not None and not transfer.ack.done():
                transfer.abort("prefill failed or was cancelled")
            await self.engine.call(lambda: self._forget(request_id))

    def _forget(self, request_id: str) -> None:
        """Engine thread: free the request's blocks. Abort first: a call cancelled while its
        `add_request` waited for the engine thread leaves a request the engine would still run."""
        self.engine.engine.abort(request_id)
        self.engine.engine.release(request_id)

    async def _run_prefill(self, request_id, prompt, params, context):
        try:
            async for out in self.engine.generate(request_id, prompt, params, prefill_only=True):
                if out.new_token_ids:
                    return out.new_token_ids[0], out
        except InvalidRequestError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        await context.abort(grpc.StatusCode.ABORTED, "prefill was aborted")

    def _on_layer_written(self, seqs: list[Sequence], layer: int) -> None:
        """Engine thread, right after `layer` ran: hand this layer's KV of finishing prompts to the sender."""
        cache = self.engine.engine.kv_cache
        for seq in seqs:
            transfer = self._transfers.get(seq.request_id)
            if transfer is not None:
                k, v = cache.read_tokens(layer, seq.block_ids, seq.num_prompt_tokens)
                transfer.send_layer(layer, k, v)
                reached(_HOOK, "prefill.after_layer", seq.request_id, layer)

    async def _send_all_layers(self, request_id: str, transfer) -> None:
        engine = self.engine.engine

        def read_all():
            block_ids, num_tokens = engine.held_kv(request_id)
            return [engine.kv_cache.read_tokens(layer, block_ids, num_tokens) for layer in range(engine.layout.num_layers)]

        for layer, (k, v) in enumerate(await self.engine.call(read_all)):
            transfer.send_layer(layer, k, v)

    async def Stats(self, request: pb.StatsRequest, context) -> pb.WorkerStats:
        return await worker_stats(self.engine, self.worker_id, pb.ROLE_PREFILL, self.draining, kv_bytes_sent=self.sender.stats.bytes_sent)

    async def drain(self, grace_s: float) -> None:
        self.draining = True
        await wait_idle(lambda: self.in_flight)


def _first_token(token_id: int, out) -> pb.FirstToken:
    """The sampled first token, with its logprobs when the request asked for them."""
    first = pb.FirstToken(token_id=token_id)
    chunk = chunk_from_output(out)
    if chunk.logprobs:
        first.logprob.CopyFrom(chunk.logprobs[0])
    return first

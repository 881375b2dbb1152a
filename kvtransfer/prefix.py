"""Pulling a prompt prefix's KV from the worker that holds it, instead of computing it.

The router's index (router/kv_index.py) knows which worker's prefix cache holds the most of a prompt's
leading blocks; with `router.kv_pull` it names that worker in the `PrefillRequest` (`kv_source`) when
it holds more than the prefill worker does. One pull, on the puller (a prefill worker, `PrefixPuller`):
  1. reserve blocks for the prefix (`reserve_remote_kv`: the blocks it already holds are reused), and
     decide from measured rates whether moving the rest beats computing it (engine.kv_tier.LoadRates:
     seconds per pulled block from earlier pulls, seconds per prompt token from its own steps);
  2. expect the transfer on its own KV receiver and ask the holder (`SendPrefix` over the cluster's
     internal channel: TLS and the shared secret) to send the KV of the rest;
  3. the holder (`PrefixSource`) pins those blocks (`hold_prefix`), sends them over kvtransfer (the
     wire every transfer uses: signed header, fingerprint, per-layer checksums) and releases them;
  4. once verified, the blocks join the puller's prefix cache (`cache_received`), and the prompt's own
     prefill finds them there like any cached prefix.
Any failure (the holder gone or evicted, a timeout, a bad checksum) cancels the transfer, frees the
reservation and leaves the prefix to be computed: a pull can cost time, never the request.
Tensor-parallel workers do not pull (each rank holds only its heads).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

import grpc

from common.sampling import SamplingParams
from engine.async_engine import AsyncEngine
from engine.kv_tier import LoadRates
from kvtransfer.errors import KVTransferError
from kvtransfer.faults import FaultPoint, reached
from kvtransfer.messages import KVEndpoint, ReceivedKV
from kvtransfer.pieces import Destination, PieceSend
from kvtransfer.receiver import KVReceiver
from kvtransfer.sender import KVSender
from proto.pdserve.v1 import pdserve_pb2 as pb
from proto.pdserve.v1 import pdserve_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)


class PrefixSource:
    """A worker's side of `SendPrefix`: send the KV of a prefix its prefix cache holds."""

    def __init__(self, engine: AsyncEngine, sender: Callable[[], KVSender], fingerprint: str, fault_point: FaultPoint | None = None):
        """`sender()`: the worker's KV sender (a decode worker makes one at its first `send`)."""
        self.engine, self.sender, self.fingerprint = engine, sender, fingerprint
        self.fault_point = fault_point
        self.sent_bytes = 0

    async def send(self, request: pb.SendPrefixRequest, context: grpc.aio.ServicerContext) -> pb.SendPrefixResponse:
        dest = request.kv_destination
        prefix = list(request.token_ids)
        hold_id = f"{request.request_id}-source-{uuid.uuid4().hex[:6]}"
        if self.engine.tensor_parallel_size > 1:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "a tensor-parallel worker sends no prefixes")
        if not await self.engine.hold_prefix(hold_id, prefix):
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"token_ids: the prefix cache no longer holds all {len(prefix)} tokens")
        try:
            reached(self.fault_point, "source.before_send", request.request_id)
            layout = self.engine.global_layout
            destination = Destination(dest.transfer_id, self.fingerprint, [KVEndpoint(dest.endpoint.host, dest.endpoint.port, dest.endpoint.transport)],
                                      dest.num_kv_heads or layout.num_kv_heads, dest.held_tokens)
            try:
                send = PieceSend(self.sender(), destination, layout, len(prefix))
            except ValueError as exc:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"kv_destination.held_tokens: {exc}")
            for layer, (k, v) in enumerate(await self.engine.prompt_kv(hold_id)):
                send.send_layer(layer, k[send.start:], v[send.start:])
            send.finish(0)  # no token was sampled: the puller reads none
            try:
                sent = await send.wait()
            except KVTransferError as exc:
                await context.abort(grpc.StatusCode.UNAVAILABLE, f"kv transfer failed ({exc.code.name}): {exc}")
            self.sent_bytes += sent
            return pb.SendPrefixResponse(kv_bytes_sent=sent)
        finally:
            await self.engine.release(hold_id)


@dataclass
class PullStats:
    pulls: int = 0
    pulled_tokens: int = 0
    failed: int = 0
    skipped: int = 0
    """Pulls not tried: computing was measured cheaper, or the worker held the prefix already."""
    seconds: float = 0.0
    """Wall time of the pulls tried (failed ones included)."""
    received_bytes: int = 0

    def worker_stats_fields(self) -> dict:
        """These counters as pb.WorkerStats fields."""
        return {"kv_pulls": self.pulls, "kv_pulled_tokens": self.pulled_tokens, "kv_pull_failures": self.failed,
                "kv_pulls_declined": self.skipped, "kv_pull_seconds": self.seconds}


class PrefixPuller:
    """A prefill worker's side: pull a prefix from its holder into this worker's prefix cache."""

    def __init__(self, engine: AsyncEngine, receiver: KVReceiver, fingerprint: str, channel_for: Callable[[str], grpc.aio.Channel],
                 timeout_s: float):
        """`channel_for(address)`: a channel to another worker over the internal plane (common/security.py)."""
        self.engine, self.receiver, self.fingerprint = engine, receiver, fingerprint
        self.channel_for, self.timeout_s = channel_for, timeout_s
        self.rates = LoadRates()
        self.stats = PullStats()
        self._channels: dict[str, grpc.aio.Channel] = {}

    async def close(self) -> None:
        for channel in self._channels.values():
            await channel.close()
        await self.receiver.close()

    async def pull(self, request_id: str, prompt: list[int], source: pb.KVSource) -> int:
        """Pull the prompt's first `source.num_tokens` tokens' KV; the tokens pulled (0: none, the prefix is
        computed as usual)."""
        if self.engine.tensor_parallel_size > 1 or source.num_tokens == 0 or source.num_tokens >= len(prompt):
            return 0
        self.rates.compute_s_per_token = self.engine.prompt_s_per_token
        if not self.rates.load_pays(self.engine.layout.block_size):  # decided before any engine call: a declined pull costs nothing
            self.stats.skipped += 1
            return 0
        prefix = prompt[: source.num_tokens]
        pull_id = f"{request_id}-pull-{uuid.uuid4().hex[:6]}"
        reserved = await self.engine.reserve_remote_kv(pull_id, prefix, SamplingParams(max_tokens=1))
        if reserved is None:
            self.stats.skipped += 1
            return 0
        started = time.monotonic()
        try:
            received = await self._transfer(pull_id, prefix, reserved, source)
        except (KVTransferError, grpc.aio.AioRpcError, TimeoutError) as exc:
            self.stats.failed += 1
            self.stats.seconds += time.monotonic() - started
            self.rates.observe_load(time.monotonic() - started, reserved.moved_blocks)  # time spent for nothing counts too
            log.warning("request %s: pulling %d tokens from %s failed, computing them (%s)", request_id, len(prefix), source.worker_id, exc)
            await self.engine.abort(pull_id)
            return 0
        await self.engine.cache_received(pull_id)
        pulled = len(prefix) - reserved.held_tokens
        self.rates.observe_load(time.monotonic() - started, reserved.moved_blocks)
        self.stats.pulls += 1
        self.stats.pulled_tokens += pulled
        self.stats.seconds += time.monotonic() - started
        self.stats.received_bytes += received.nbytes
        return pulled

    async def _transfer(self, pull_id: str, prefix: list[int], reserved, source: pb.KVSource) -> ReceivedKV:
        transfer_id = f"{pull_id}-{uuid.uuid4().hex[:6]}"
        expected = self.receiver.expect_pieces(transfer_id, reserved.incoming_block_ids, len(prefix) - reserved.held_tokens, self.fingerprint,
                                        timeout=self.timeout_s)
        endpoint = self.receiver.endpoint
        dest = pb.KVDestination(endpoint=pb.KVEndpoint(host=endpoint.host, port=endpoint.port, transport=endpoint.transport),
                                transfer_id=transfer_id, model_fingerprint=self.fingerprint,
                                num_kv_heads=self.engine.global_layout.num_kv_heads, held_tokens=reserved.held_tokens)
        if source.address not in self._channels:
            self._channels[source.address] = self.channel_for(source.address)
        stub = (pb_grpc.DecodeWorkerStub if source.role == pb.ROLE_DECODE else pb_grpc.PrefillWorkerStub)(self._channels[source.address])
        try:
            await stub.SendPrefix(pb.SendPrefixRequest(request_id=pull_id, token_ids=prefix, kv_destination=dest), timeout=self.timeout_s)
            return await asyncio.wait_for(asyncio.shield(expected), timeout=self.timeout_s)
        except BaseException:
            self.receiver.cancel(transfer_id, "the pull failed")
            await asyncio.wait([expected], timeout=self.receiver.settle_timeout + 1)  # no write may land after the blocks are freed
            if expected.done() and not expected.cancelled():
                expected.exception()
            raise

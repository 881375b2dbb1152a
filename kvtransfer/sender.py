"""Prefill side of KV transfer: stream a request's KV, layer by layer, to a decode worker.

Lifecycle: a `KVSender` owns one asyncio loop (its own daemon thread by default, or a loop the
caller gives it) and a cache of open connections, one per receiver endpoint, reused by every
transfer to that endpoint and dropped when it breaks. Per transfer:

    xfer = sender.begin(endpoint, header)        # any thread; returns at once
    xfer.send_layer(layer, k, v)                  # engine thread, right after layer's forward
    ...
    ack = await xfer.finish(first_token).wait()   # or xfer.finish(t).result(timeout) in a thread

`begin`, `send_layer`, `finish` and `abort` only enqueue work for the sender's loop, so the
engine's compute thread never waits on the network. The loop connects (or reuses the
connection), sends BEGIN, checksums and sends each layer as it arrives, sends the TRAILER and
waits for the receiver's RESULT. A receiver error (fingerprint, shape, checksum, unknown id,
timeout, cancel) ends the transfer early with the matching typed exception; later layers are
dropped without being sent. `close()` fails unfinished transfers and closes connections.
A `FaultInjector` (tests only, off by default) may delay, drop, truncate, corrupt or cut
layers on their way out; see kvtransfer/faults.py.

Tensors handed to `send_layer` belong to the sender until the transfer is done; do not modify
them (pass `KVCache.read_tokens` results, which are copies).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any, Self

import torch

from common.config import KVTransferConfig
from engine.kv_cache import KVCache
from kvtransfer import checksum, codec
from kvtransfer.connection import Connection
from kvtransfer.errors import ErrorCode, KVTransferError, ProtocolError, ShapeMismatch, TransferAborted, TransferTimeout, error_from_code
from kvtransfer.faults import FaultInjector
from kvtransfer.messages import KVEndpoint, SenderStats, TransferAck
from kvtransfer.transport.base import Channel, ChannelClosed, Transport, get_transport
from kvtransfer.wire import Frame, FrameKind, LayerMeta, Result, Trailer, TransferHeader, digest, encode_reason, sign_begin

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Layer:
    layer: int
    k: torch.Tensor
    v: torch.Tensor


@dataclass(frozen=True)
class _Finish:
    first_token: int
    logprob: float | None
    top_logprobs: tuple[tuple[int, float], ...]


@dataclass(frozen=True)
class _Abort:
    reason: str


class OutgoingTransfer:
    """One transfer in flight. All methods are thread-safe and never block on I/O."""

    def __init__(self, sender: KVSender, endpoint: KVEndpoint, header: TransferHeader, ack_timeout: float):
        self.sender = sender
        self.endpoint = endpoint
        self.header = header
        self.ack_timeout = ack_timeout
        self.network_s = 0.0  # time blocked sending layers (kvtransfer.codec.WirePolicy's link rate)
        self.started_at = time.monotonic()
        self._queue: asyncio.Queue[_Layer | _Finish | _Abort] = asyncio.Queue()
        self._caller_done = False  # finish() or abort() was called
        self._dropped = False  # a fault dropped a layer: the rest and the trailer are never sent
        self._lock = threading.Lock()
        self._ack: concurrent.futures.Future[TransferAck] = asyncio.run_coroutine_threadsafe(self._run(), sender.loop)

    @property
    def transfer_id(self) -> str:
        return self.header.transfer_id

    def _put(self, item: _Layer | _Finish | _Abort) -> None:
        with self._lock:
            if self._caller_done:
                raise RuntimeError(f"transfer {self.transfer_id}: send after finish() or abort()")
            if not isinstance(item, _Layer):
                self._caller_done = True
        if self._ack.done():
            return  # the transfer already ended (its error is in the ack); drop quietly
        self.sender.loop.call_soon_threadsafe(self._queue.put_nowait, item)

    def send_layer(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Queue layer `layer`'s K and V (`[num_tokens, kv_heads, head_dim]`) for sending."""
        self._put(_Layer(layer, k, v))

    def send_from_cache(self, cache: KVCache, block_ids: list[int], layers: range | None = None) -> None:
        """Queue the given layers (default: all) of this request read from a paged pool."""
        for layer in layers if layers is not None else range(cache.layout.num_layers):
            k, v = cache.read_tokens(layer, block_ids, self.header.num_tokens)
            self.send_layer(layer, k, v)

    def finish(
        self, first_token: int, logprob: float | None = None, top_logprobs: Mapping[int, float] | None = None
    ) -> concurrent.futures.Future[TransferAck]:
        """Send the trailer (the first token, with its logprobs when the request asked for them);
        the returned future resolves when the receiver acknowledged."""
        self._put(_Finish(first_token, logprob, tuple((top_logprobs or {}).items())))
        return self._ack

    def abort(self, reason: str) -> None:
        """Give up (prefill failed or was cancelled); the receiver fails the transfer."""
        try:
            self._put(_Abort(reason))
        except RuntimeError:
            pass

    @property
    def ack(self) -> concurrent.futures.Future[TransferAck]:
        return self._ack

    async def wait(self, timeout: float | None = None) -> TransferAck:
        """Await the receiver's ack from any event loop."""
        try:
            return await asyncio.wait_for(asyncio.wrap_future(self._ack), timeout)
        except TimeoutError:
            raise TransferTimeout(f"no ack within {timeout}s", self.transfer_id) from None

    def result(self, timeout: float | None = None) -> TransferAck:
        """Block the calling thread (not the sender's loop) until the ack."""
        try:
            return self._ack.result(timeout)
        except concurrent.futures.TimeoutError:
            raise TransferTimeout(f"no ack within {timeout}s", self.transfer_id) from None

    # --- runs on the sender's loop --------------------------------------------------------

    async def _run(self) -> TransferAck:
        tid = self.transfer_id
        conn: Connection | None = None
        stream = 0
        result: asyncio.Future[Result] | None = None
        task = asyncio.current_task()
        assert task is not None
        self.sender._tasks.add(task)
        try:
            conn = await self.sender._connection(self.endpoint)
            peer_checksums = conn.channel.hello.checksums if conn.channel.hello else ()
            self.header = replace(self.header, checksum=checksum.choose(peer_checksums, self.sender.checksums),
                                  wire_dtype=self.sender.wire.choose(self.endpoint.host))
            stream, result = conn.open_stream()
            await conn.channel.send(Frame(FrameKind.BEGIN, stream, sign_begin(self.header.encode(), self.sender.secret)))
            crcs: dict[int, int] = {}
            while True:
                item = await self._next(result)
                if isinstance(item, _Layer):
                    crcs[item.layer] = await self._send_layer(conn.channel, stream, item)
                elif isinstance(item, _Abort):
                    await self._tell_receiver(conn, stream, result, item.reason)
                    result = None  # told; do not tell again below
                    raise TransferAborted(f"aborted by sender: {item.reason}", tid)
                elif self._dropped:
                    log.warning("fault injection: transfer %s trailer dropped", tid)
                    break
                else:
                    layer_sums = [crcs[i] for i in sorted(crcs)]
                    trailer = Trailer(item.first_token, len(crcs), digest(layer_sums, self.header.checksum), item.logprob, item.top_logprobs)
                    await conn.channel.send(Frame(FrameKind.TRAILER, stream, trailer.encode()))
                    break
            return await self._await_ack(result, len(crcs))
        except ChannelClosed as exc:
            self.sender.stats.failed += 1
            raise TransferAborted(f"receiver connection lost: {exc}", tid) from None
        except KVTransferError as exc:
            self.sender.stats.failed += 1
            await self._tell_receiver(conn, stream, result, str(exc))
            raise
        except asyncio.CancelledError:
            self.sender.stats.failed += 1
            raise TransferAborted("sender closed", tid) from None
        except Exception as exc:
            self.sender.stats.failed += 1
            await self._tell_receiver(conn, stream, result, f"sender error: {exc!r}")
            raise
        finally:
            self.sender._tasks.discard(task)
            if conn is not None:
                conn.close_stream(stream)
            self._drain_queue()

    async def _await_ack(self, result: asyncio.Future[Result], layers: int) -> TransferAck:
        tail = time.monotonic()
        try:
            outcome = await asyncio.wait_for(result, self.ack_timeout)
        except TimeoutError:
            where = f"{self.endpoint.host}:{self.endpoint.port}"
            raise TransferTimeout(f"no RESULT from {where} within {self.ack_timeout}s", self.transfer_id) from None
        self._raise_for(outcome)
        self.sender.wire.record(self.endpoint.host, self.header.nbytes, self.network_s + time.monotonic() - tail)
        self.sender.stats.acked += 1
        return TransferAck(self.transfer_id, self.header.nbytes, layers, time.monotonic() - self.started_at)

    @staticmethod
    async def _tell_receiver(
        conn: Connection | None, stream: int, result: asyncio.Future[Result] | None, reason: str
    ) -> None:
        """Send ABORT for a stream the receiver has not already ended itself."""
        if conn is None or result is None or result.done() or conn.channel.closed:
            return
        try:
            await asyncio.wait_for(conn.channel.send(Frame(FrameKind.ABORT, stream, encode_reason(reason))), 2.0)
        except (TimeoutError, ChannelClosed, OSError):
            pass

    async def _next(self, result: asyncio.Future[Result]) -> _Layer | _Finish | _Abort:
        """Next queued item, or raise as soon as the receiver reports an outcome early."""
        if not self._queue.empty():
            item = self._queue.get_nowait()
        else:
            getter = asyncio.ensure_future(self._queue.get())
            await asyncio.wait({getter, result}, return_when=asyncio.FIRST_COMPLETED)
            if not getter.done():
                getter.cancel()
                self._raise_for(result.result(), early=True)
            item = getter.result()
        if result.done():
            self._raise_for(result.result(), early=True)
        return item

    def _raise_for(self, outcome: Result, early: bool = False) -> None:
        if outcome.code == ErrorCode.OK:
            if early:
                raise ProtocolError("receiver acknowledged before the trailer", self.transfer_id)
            return
        raise error_from_code(outcome.code, f"receiver: {outcome.message}", self.transfer_id)

    async def _send_layer(self, channel: Channel, stream: int, item: _Layer) -> int:
        parts = codec.encode_parts(item.k, item.v, self.header.head_dim, self.header.wire_dtype)
        if self.sender.faults:
            parts = self.sender.faults.forge(self.transfer_id, item.layer, parts)
        size = self.header.bytes_per_part
        if len(parts[0]) != size or len(parts[1]) != size:
            raise ShapeMismatch(
                f"layer {item.layer}: K/V of {len(parts[0])}/{len(parts[1])} B, header says {size} B", self.transfer_id
            )
        crc = await checksum.compute_off_loop(self.header.checksum, parts, 2 * size)
        wire = await self._apply_faults(channel, item.layer, parts) if self.sender.faults else parts
        if wire is None:
            return crc
        meta = LayerMeta(item.layer, size, size, crc)
        sending = time.monotonic()
        await channel.send(Frame(FrameKind.LAYER, stream, meta.encode(), tuple(len(p) for p in wire)), wire)
        self.network_s += time.monotonic() - sending
        self.sender.stats.bytes_sent += sum(len(p) for p in wire)
        return crc

    async def _apply_faults(self, channel: Channel, layer: int, parts: list[Any]) -> list[Any] | None:
        """Test hook (kvtransfer.faults): the parts to send for `layer`, or None to drop them."""
        assert self.sender.faults is not None
        plan = self.sender.faults.plan(self.transfer_id, layer)
        if plan.delay_s:
            await asyncio.sleep(plan.delay_s)
        if plan.cut:
            await channel.close()
            raise ChannelClosed(f"fault injection: connection cut before layer {layer}")
        if plan.drop:
            self._dropped = True
            return None
        return FaultInjector.damage(plan, parts)

    def _drain_queue(self) -> None:
        while not self._queue.empty():
            self._queue.get_nowait()


class KVSender:
    """Opens, caches and reuses connections to receivers; starts transfers on its loop."""

    def __init__(
        self,
        *,
        loop: asyncio.AbstractEventLoop | None = None,
        connect_timeout: float = 5.0,
        ack_timeout: float = 30.0,
        faults: FaultInjector | None = None,
        transport_options: dict[str, dict[str, Any]] | None = None,
        checksums: tuple[str, ...] | None = None,
        secret: str | bytes = b"",
        wire: codec.WirePolicy | None = None,
    ):
        self.connect_timeout = connect_timeout
        self.ack_timeout = ack_timeout
        self.faults = faults
        self.checksums = checksums  # preference order; None: fastest available (crc32c, crc32)
        self.secret = secret.encode() if isinstance(secret, str) else bytes(secret)  # signs BEGIN (wire.sign_begin)
        self.stats = SenderStats()
        self.wire = wire or codec.WirePolicy()  # wire dtype per transfer (kvtransfer/codec.py)
        self._transport_options = transport_options or {}
        self._transports: dict[str, Transport] = {}
        self._connections: dict[tuple[str, str, int], Connection] = {}
        self._connecting: dict[tuple[str, str, int], asyncio.Lock] = {}
        self._tasks: set[asyncio.Task[TransferAck]] = set()
        self._thread: threading.Thread | None = None
        if loop is None:
            loop = asyncio.new_event_loop()
            self._thread = threading.Thread(target=self._run_loop, args=(loop,), name="kv-sender", daemon=True)
            self._thread.start()
        self.loop = loop
        self._closed = False

    @staticmethod
    def _run_loop(loop: asyncio.AbstractEventLoop) -> None:
        asyncio.set_event_loop(loop)
        loop.run_forever()

    def begin(self, endpoint: KVEndpoint, header: TransferHeader, ack_timeout: float | None = None) -> OutgoingTransfer:
        """Start a transfer to `endpoint` (thread-safe, returns at once)."""
        if self._closed:
            raise RuntimeError("KVSender is closed")
        return OutgoingTransfer(self, endpoint, header, ack_timeout if ack_timeout is not None else self.ack_timeout)

    def prepare(self, transport: str, timeout: float = 60.0) -> None:
        """Pay `transport`'s one-time setup on this sender's loop now, not in the first transfer (call it
        from another thread than the loop's, e.g. while the worker starts)."""

        async def on_loop() -> None:
            await self._transport(transport).prepare()

        asyncio.run_coroutine_threadsafe(on_loop(), self.loop).result(timeout)

    def _transport(self, name: str) -> Transport:
        if name not in self._transports:
            self._transports[name] = get_transport(name, **self._transport_options.get(name, {}))
        return self._transports[name]

    async def _connection(self, endpoint: KVEndpoint) -> Connection:
        key = (endpoint.transport, endpoint.host, endpoint.port)
        lock = self._connecting.setdefault(key, asyncio.Lock())
        async with lock:
            conn = self._connections.get(key)
            if conn is not None and not conn.channel.closed and not conn.reader.done():
                return conn
            if self._closed:
                raise ChannelClosed("sender is closed")
            channel = await self._transport(endpoint.transport).connect(endpoint.host, endpoint.port, self.connect_timeout)
            conn = Connection(channel)
            conn.reader.add_done_callback(lambda _: self._forget(key, conn))
            self._connections[key] = conn
            log.info("KV connection to %s:%d (%s) open", endpoint.host, endpoint.port, endpoint.transport)
            return conn

    def _forget(self, key: tuple[str, str, int], conn: Connection) -> None:
        if self._connections.get(key) is conn:
            del self._connections[key]

    async def aclose(self) -> None:
        """Close every connection (unfinished transfers fail with TransferAborted)."""
        self._closed = True
        conns = list(self._connections.values())
        self._connections.clear()
        for conn in conns:
            await conn.close()
        if self._tasks:
            _, stuck = await asyncio.wait(set(self._tasks), timeout=2.0)
            for task in stuck:
                task.cancel()
            if stuck:
                await asyncio.wait(stuck, timeout=2.0)

    def close(self, timeout: float = 10.0) -> None:
        """Close from any thread other than the sender's loop; stops the owned loop thread."""
        if self.loop.is_closed():
            return
        try:
            in_loop = asyncio.get_running_loop() is self.loop
        except RuntimeError:
            in_loop = False
        if in_loop:
            raise RuntimeError("KVSender.close() called on its own loop; use `await aclose()`")
        if self.loop.is_running():
            try:
                asyncio.run_coroutine_threadsafe(self.aclose(), self.loop).result(timeout)
            except concurrent.futures.TimeoutError:
                log.warning("KVSender close timed out after %.1fs", timeout)
        if self._thread is not None:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout)
            self.loop.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def make_sender(kv: KVTransferConfig, secret: bytes, faults: FaultInjector | None = None) -> KVSender:
    """A worker's (or rank's) KV sender for its config, its transport set up before the first request needs it."""
    sender = KVSender(ack_timeout=kv.timeout_s, faults=faults, secret=secret, wire=codec.WirePolicy(kv.wire_dtype, kv.compress_below_gbps))
    sender.prepare(kv.transport)
    return sender

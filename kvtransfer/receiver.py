"""Decode side of KV transfer: accept connections, land expected transfers in the KV pool.

Lifecycle of one transfer, owned by `KVReceiver`:

1. `expect(transfer_id, block_ids, num_tokens, fingerprint, timeout)` registers it (the decode
   worker has allocated the blocks) and returns a future; a deadline timer starts.
2. BEGIN from a sender binds it to that connection's stream after checking the model
   fingerprint, the KV layout and the token count. With a shared secret (`secret=`), a BEGIN
   whose HMAC proof is missing or wrong is refused first (AuthenticationFailed, counted in
   `stats.failed["UNAUTHENTICATED"]`): it binds nothing, so none of its bytes reach the pool.
3. Each LAYER is received straight into the request's blocks (or staged and then written with
   `KVCache.write_tokens`), and its checksum (crc32c or crc32) is checked off the event loop.
4. TRAILER: once every layer has landed and matched its crc and the digest matches, the future
   resolves with `ReceivedKV` (first token) and the sender gets RESULT OK.

Any failure (bad header, bad layer, checksum, deadline, `cancel`, sender gone, receiver
closing) fails the future with a typed `KVTransferError` and tells the sender the code. The
future resolves only after no transport write into the blocks is outstanding, so when it
resolves, success or failure, the receiver is done with the blocks and the caller may free or
reuse them. Garbage is never marked complete: completion requires every layer's checksum.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Self

from engine.kv_cache import KVCache
from kvtransfer import checksum, codec, errors
from kvtransfer.buffers import K, PoolTarget, V
from kvtransfer.errors import ErrorCode, KVTransferError
from kvtransfer.messages import KVEndpoint, ReceivedKV, ReceiverStats
from kvtransfer.pieces import PieceGroups
from kvtransfer.sharding import HeadRange
from kvtransfer.transport.base import Channel, ChannelClosed, Listener, Transport, get_transport
from kvtransfer.wire import Frame, FrameKind, LayerMeta, Result, Trailer, TransferHeader, decode_reason, digest, verify_begin

log = logging.getLogger(__name__)


@dataclass(eq=False)
class _Transfer:
    transfer_id: str
    block_ids: list[int]
    num_tokens: int
    fingerprint: str
    future: asyncio.Future[ReceivedKV]
    expected_at: float
    timer: asyncio.TimerHandle | None = None
    channel: Channel | None = None
    stream: int = -1
    header: TransferHeader | None = None
    target: PoolTarget | codec.WireTarget | None = None
    begun_at: float = 0.0
    layer_crcs: dict[int, int] = field(default_factory=dict)
    layers_seen: set[int] = field(default_factory=set)
    landing: set[asyncio.Task[None]] = field(default_factory=set)
    streams: dict[int, _Transfer] | None = None  # the connection's stream table while bound
    failed: bool = False
    completed: bool = False
    group: Any = None
    """The PieceGroup this transfer is one piece of (tensor-parallel sender), else None."""


class KVReceiver:
    """Listens for senders and lands the transfers the decode worker expects into `cache`.

    Runs on the event loop that calls `start()`; call `expect`/`cancel` from that loop."""

    def __init__(
        self,
        cache: KVCache,
        transport: str | Transport = "ucx",
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        zero_copy: bool = True,
        settle_timeout: float = 5.0,
        secret: str | bytes = b"",
        heads: HeadRange | None = None,
        **transport_options: Any,
    ):
        self.cache = cache
        self._secret = secret.encode() if isinstance(secret, str) else bytes(secret)
        self.transport = get_transport(transport, **transport_options) if isinstance(transport, str) else transport
        self.host = host
        self.port = port
        self.zero_copy = zero_copy
        self.settle_timeout = settle_timeout
        self.stats = ReceiverStats()
        self._listener: Listener | None = None
        self._expected: dict[str, _Transfer] = {}
        self.heads = heads or HeadRange(0, cache.layout.num_kv_heads)
        """The global KV heads this receiver's pool holds (its rank's share under tensor parallelism)."""
        self.pieces = PieceGroups(self)
        self._tasks: set[asyncio.Task[Any]] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closing = False

    # --- lifecycle ------------------------------------------------------------------------

    async def start(self) -> KVEndpoint:
        self._loop = asyncio.get_running_loop()
        self._listener = await self.transport.listen(self.host, self.port, self._serve)
        log.info("KV receiver (%s) on %s:%d", self.transport.name, self._listener.host, self._listener.port)
        return self.endpoint

    @property
    def endpoint(self) -> KVEndpoint:
        if self._listener is None:
            raise RuntimeError("KVReceiver.start() was not called")
        return KVEndpoint(self._listener.host, self._listener.port, self.transport.name)

    async def close(self) -> None:
        """Fail every pending transfer (TransferAborted), close connections and the listener."""
        self._closing = True
        self.pieces.close()
        for xfer in list(self._expected.values()):
            self._fail(xfer, errors.TransferAborted("receiver is closing", xfer.transfer_id))
        if self._listener is not None:
            await self._listener.close()
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=self.settle_timeout + 1)

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # --- decode worker API ----------------------------------------------------------------

    def expect(
        self,
        transfer_id: str,
        block_ids: list[int],
        num_tokens: int,
        fingerprint: str,
        timeout: float,
    ) -> asyncio.Future[ReceivedKV]:
        """Register a transfer of all this receiver's heads from one sender; the future resolves with
        `ReceivedKV` once its KV is verified in `block_ids`, or fails with a KVTransferError. Free the
        blocks only after it resolves."""
        self._check_open(transfer_id, num_tokens)
        return self._register(transfer_id, block_ids, num_tokens, fingerprint, timeout).future

    def expect_pieces(
        self, transfer_id: str, block_ids: list[int], num_tokens: int, fingerprint: str, timeout: float
    ) -> asyncio.Future[ReceivedKV]:
        """Like `expect`, for a tensor-parallel sender: this receiver's heads arrive as pieces
        `transfer_id#k` from several sender ranks (kvtransfer.pieces); the future resolves once they
        cover every head, or fails when any piece fails."""
        self._check_open(transfer_id, num_tokens)
        PoolTarget(self.cache, block_ids, num_tokens)  # validates the blocks now
        return self.pieces.expect(transfer_id, block_ids, num_tokens, fingerprint, timeout)

    def _check_open(self, transfer_id: str, num_tokens: int) -> None:
        if self._closing:
            raise RuntimeError("receiver is closed")
        if asyncio.get_running_loop() is not self._loop:
            raise RuntimeError("call expect() on the loop that started the receiver")
        if transfer_id in self._expected or self.pieces.has(transfer_id):
            raise ValueError(f"transfer {transfer_id!r} is already expected")
        if num_tokens < 1:
            raise ValueError("num_tokens must be >= 1")

    def _register(self, transfer_id: str, block_ids: list[int], num_tokens: int, fingerprint: str, timeout: float) -> _Transfer:
        loop = asyncio.get_running_loop()
        xfer = _Transfer(
            transfer_id=transfer_id,
            block_ids=list(block_ids),
            num_tokens=num_tokens,
            fingerprint=fingerprint,
            future=loop.create_future(),
            expected_at=time.monotonic(),
        )
        xfer.target = PoolTarget(self.cache, xfer.block_ids, num_tokens, self.zero_copy)  # validates blocks
        xfer.timer = loop.call_later(timeout, self._on_deadline, xfer, timeout)
        self._expected[transfer_id] = xfer
        return xfer

    def cancel(self, transfer_id: str, reason: str = "cancelled by the decode worker") -> bool:
        """Fail a pending transfer with TransferAborted; False if it is not pending."""
        if self.pieces.cancel(transfer_id, reason):
            return True
        xfer = self._expected.get(transfer_id)
        if xfer is None:
            return False
        self._fail(xfer, errors.TransferAborted(reason, transfer_id))
        return True

    @property
    def pending(self) -> int:
        return len(self._expected) + self.pieces.pending

    # --- per connection -------------------------------------------------------------------

    async def _serve(self, channel: Channel) -> None:
        streams: dict[int, _Transfer] = {}
        log.debug("KV sender connected from %s", channel.peer)
        try:
            while True:
                frame = await channel.recv()
                claimed = self._dispatch(channel, streams, frame)
                if frame.payload_nbytes and not claimed:
                    self._track(channel.discard_payload(frame))
        except ChannelClosed:
            pass
        except errors.ProtocolError as exc:
            log.warning("dropping KV connection from %s: %s", channel.peer, exc)
        finally:
            for xfer in list(streams.values()):
                self._fail(xfer, errors.TransferAborted(f"sender {channel.peer} disconnected mid-transfer", xfer.transfer_id))
            await channel.close()

    def _dispatch(self, channel: Channel, streams: dict[int, _Transfer], frame: Frame) -> bool:
        """Handle one frame; True if its payload was claimed."""
        if frame.kind == FrameKind.BEGIN:
            self._on_begin(channel, streams, frame)
        elif frame.kind == FrameKind.LAYER:
            return self._on_layer(channel, streams, frame)
        elif frame.kind == FrameKind.TRAILER:
            self._on_trailer(streams, frame)
        elif frame.kind == FrameKind.ABORT:
            xfer = streams.pop(frame.stream, None)
            if xfer is not None:
                reason = decode_reason(frame.body)
                self._fail(xfer, errors.TransferAborted(f"sender aborted: {reason}", xfer.transfer_id), notify=False)
        else:
            raise errors.ProtocolError(f"unexpected {frame.kind.name} frame from a sender")
        return False

    def _on_begin(self, channel: Channel, streams: dict[int, _Transfer], frame: Frame) -> None:
        if frame.stream in streams:
            raise errors.ProtocolError(f"stream {frame.stream} begun twice")
        try:
            header = TransferHeader.decode(frame.body)
            refusal = verify_begin(frame.body, self._secret)
        except errors.ProtocolError as exc:
            self._reply(channel, frame.stream, exc.code, str(exc))
            return
        if refusal is not None:
            self._refuse(channel, frame.stream, header, refusal)
            return
        xfer = self._expected.get(header.transfer_id) or self.pieces.piece_for(header)
        if xfer is None or xfer.channel is not None:
            what = "not expected (unknown, finished or timed out)" if xfer is None else "already being received"
            log.warning("rejecting transfer %s from %s: %s", header.transfer_id, channel.peer, what)
            self.stats.failed[ErrorCode.UNKNOWN_TRANSFER.name] += 1
            self._reply(channel, frame.stream, ErrorCode.UNKNOWN_TRANSFER, f"transfer {header.transfer_id} {what}")
            return
        xfer.channel, xfer.stream, xfer.header = channel, frame.stream, header
        xfer.begun_at = time.monotonic()
        streams[frame.stream] = xfer
        xfer.streams = streams
        problem = self._check_header(xfer, header)
        if problem is not None:
            self._fail(xfer, problem)
        elif xfer.target is not None:
            piece = HeadRange(header.first_head, header.num_kv_heads)
            if piece != self.heads:
                xfer.target = xfer.target.for_heads(piece.first - self.heads.first, piece.count)
            xfer.target = codec.target_for(xfer.target, header.wire_dtype)  # compressed: staged, decoded on commit

    def _refuse(self, channel: Channel, stream: int, header: TransferHeader, reason: str) -> None:
        """An unauthenticated BEGIN: answer UNAUTHENTICATED and leave the expected transfer of that
        id (if any) untouched, still waiting for its real sender; its layers are discarded."""
        error = errors.AuthenticationFailed(reason, header.transfer_id)
        log.warning("refusing KV transfer from %s: %s", channel.peer, error)
        self.stats.failed[error.code.name] += 1
        self._reply(channel, stream, error.code, str(error))

    def _check_header(self, xfer: _Transfer, header: TransferHeader) -> KVTransferError | None:
        if header.fingerprint != xfer.fingerprint:
            return errors.FingerprintMismatch(
                f"sender model fingerprint {header.fingerprint} != ours {xfer.fingerprint}", xfer.transfer_id
            )
        if not checksum.is_supported(header.checksum):
            return errors.ProtocolError(f"checksum {header.checksum!r} is not supported here", xfer.transfer_id)
        if header.wire_dtype not in codec.WIRE_DTYPES[1:]:
            return errors.ProtocolError(f"wire dtype {header.wire_dtype!r} is not supported here", xfer.transfer_id)
        piece = HeadRange(header.first_head, header.num_kv_heads)
        if (piece != self.heads) if xfer.group is None else (piece.overlap(self.heads) != piece):
            return errors.ShapeMismatch(
                f"sender's KV heads [{piece.first}, {piece.end}) do not fit this rank's heads [{self.heads.first}, {self.heads.end})",
                xfer.transfer_id,
            )
        layout_problem = header.layout_mismatch(dataclasses.replace(self.cache.layout, num_kv_heads=piece.count))
        if layout_problem is not None:
            return errors.ShapeMismatch(layout_problem, xfer.transfer_id)
        if header.num_tokens != xfer.num_tokens:
            return errors.ShapeMismatch(f"sender has {header.num_tokens} tokens, expected {xfer.num_tokens}", xfer.transfer_id)
        return None

    def _on_layer(self, channel: Channel, streams: dict[int, _Transfer], frame: Frame) -> bool:
        xfer = streams.get(frame.stream)
        if xfer is None:
            return False
        assert xfer.header is not None and xfer.target is not None
        meta = LayerMeta.decode(frame.body)
        size = xfer.target.part_nbytes
        if not 0 <= meta.layer < xfer.header.num_layers or meta.layer in xfer.layers_seen:
            self._fail(xfer, errors.ShapeMismatch(f"layer {meta.layer} out of range or repeated", xfer.transfer_id))
            return False
        if frame.part_sizes != (size, size) or (meta.k_nbytes, meta.v_nbytes) != (size, size):
            self._fail(
                xfer,
                errors.ShapeMismatch(f"layer {meta.layer} carries {frame.part_sizes} B, expected K and V of {size} B", xfer.transfer_id),
            )
            return False
        xfer.layers_seen.add(meta.layer)
        views = [xfer.target.views(meta.layer, K), xfer.target.views(meta.layer, V)]
        landed = channel.read_payload(frame, views)
        task = asyncio.get_running_loop().create_task(self._land_layer(xfer, meta, views, landed))
        xfer.landing.add(task)
        task.add_done_callback(xfer.landing.discard)
        return True

    async def _land_layer(self, xfer: _Transfer, meta: LayerMeta, views: list[list[memoryview]], landed: Any) -> None:
        try:
            await landed
        except Exception as exc:  # noqa: BLE001 - ChannelClosed or any transport error
            self._fail(xfer, errors.TransferAborted(f"layer {meta.layer} lost: {exc}", xfer.transfer_id))
            return
        if xfer.failed:
            return
        assert xfer.header is not None
        algorithm = xfer.header.checksum
        crc = await checksum.compute_off_loop(algorithm, views[K] + views[V], meta.k_nbytes + meta.v_nbytes)
        if xfer.failed:
            return
        if crc != meta.crc:
            self._fail(
                xfer,
                errors.ChecksumMismatch(f"layer {meta.layer} {algorithm} {crc:#010x} != sent {meta.crc:#010x}", xfer.transfer_id),
            )
            return
        assert xfer.target is not None
        xfer.target.commit(meta.layer)
        xfer.layer_crcs[meta.layer] = crc
        self.stats.layers_landed += 1

    def _on_trailer(self, streams: dict[int, _Transfer], frame: Frame) -> None:
        xfer = streams.pop(frame.stream, None)
        if xfer is None:
            return
        xfer.streams = None
        trailer = Trailer.decode(frame.body)
        self._track(asyncio.get_running_loop().create_task(self._complete(xfer, trailer)))

    async def _complete(self, xfer: _Transfer, trailer: Trailer) -> None:
        if xfer.landing:
            await asyncio.wait(set(xfer.landing))
        if xfer.failed:
            return
        assert xfer.header is not None
        n = xfer.header.num_layers
        if len(xfer.layer_crcs) != n or trailer.num_layers != n:
            self._fail(xfer, errors.ShapeMismatch(f"got {len(xfer.layer_crcs)} of {n} layers at trailer", xfer.transfer_id))
            return
        if digest([xfer.layer_crcs[i] for i in range(n)], xfer.header.checksum) != trailer.digest:
            self._fail(xfer, errors.ChecksumMismatch("transfer digest mismatch", xfer.transfer_id))
            return
        xfer.completed = True
        self._finish(xfer)
        result = ReceivedKV(
            transfer_id=xfer.transfer_id,
            first_token=trailer.first_token,
            num_tokens=xfer.num_tokens,
            nbytes=xfer.header.nbytes,
            wait_s=xfer.begun_at - xfer.expected_at,
            transfer_s=time.monotonic() - xfer.begun_at,
            first_logprob=trailer.logprob,
            first_top_logprobs=dict(trailer.top_logprobs),
        )
        self.stats.completed += 1
        self.stats.bytes_received += result.nbytes
        if not xfer.future.done():
            xfer.future.set_result(result)
        assert xfer.channel is not None
        if xfer.group is None:  # a piece is acknowledged with its whole group (kvtransfer.pieces)
            self._reply(xfer.channel, xfer.stream, ErrorCode.OK, "")

    # --- outcomes -------------------------------------------------------------------------

    def _on_deadline(self, xfer: _Transfer, timeout: float) -> None:
        state = "no sender began it" if xfer.channel is None else f"{len(xfer.layer_crcs)} layers verified"
        self._fail(xfer, errors.TransferTimeout(f"not complete after {timeout:.3g}s ({state})", xfer.transfer_id))

    def _finish(self, xfer: _Transfer) -> None:
        """Forget a transfer: later frames of its stream are dropped as unknown."""
        if xfer.timer is not None:
            xfer.timer.cancel()
        if self._expected.get(xfer.transfer_id) is xfer:
            del self._expected[xfer.transfer_id]
        if xfer.streams is not None and xfer.streams.get(xfer.stream) is xfer:
            del xfer.streams[xfer.stream]

    def _fail(self, xfer: _Transfer, error: KVTransferError, notify: bool = True) -> None:
        # a future the caller cancelled still fails here: the transfer is forgotten, its writes settled
        if xfer.failed or xfer.completed:
            return
        xfer.failed = True
        self._finish(xfer)
        self.stats.failed[error.code.name] += 1
        log.warning("KV transfer failed: %s", error)
        if notify and xfer.channel is not None and not xfer.channel.closed:
            self._reply(xfer.channel, xfer.stream, error.code, str(error))
        self._track(asyncio.get_running_loop().create_task(self._settle(xfer, error)))

    async def _settle(self, xfer: _Transfer, error: KVTransferError) -> None:
        """Resolve the future only once no payload write into the blocks is outstanding."""
        if xfer.landing:
            _, stuck = await asyncio.wait(set(xfer.landing), timeout=self.settle_timeout)
            if stuck:
                log.error("transfer %s: %d layer writes still outstanding after %.1fs", xfer.transfer_id, len(stuck), self.settle_timeout)
        if xfer.target is not None:
            xfer.target.release()
        if not xfer.future.done():
            xfer.future.set_exception(error)

    def _reply(self, channel: Channel, stream: int, code: ErrorCode, message: str) -> None:
        frame = Frame(FrameKind.RESULT, stream, Result(code, message).encode())
        self._track(asyncio.get_running_loop().create_task(self._send_quietly(channel, frame)))

    @staticmethod
    async def _send_quietly(channel: Channel, frame: Frame) -> None:
        try:
            await asyncio.wait_for(channel.send(frame), 5.0)
        except (TimeoutError, ChannelClosed, OSError):
            pass

    def _track(self, work: Any) -> None:
        task = asyncio.ensure_future(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        task.add_done_callback(lambda t: t.cancelled() or t.exception())

"""TCP transport on asyncio: frames and payloads on one stream, received in place.

Lifecycle: `TcpTransport.listen` binds a server socket (default 127.0.0.1, OS-assigned port);
each accepted connection gets a `TcpChannel`, greets the peer with a HELLO frame and is handed
to the receiver. `TcpTransport.connect` opens a connection, waits for the HELLO and checks the
peer speaks the same wire version and transport. Channels live until either side closes them.

Reading uses `asyncio.BufferedProtocol`: the event loop `recv_into`s straight into the buffer
we return from `get_buffer`, which for payload bytes is the caller's view into the KV pool, so
payloads cross no intermediate copy. Between a frame with payload and the caller claiming it,
reading is paused, which also gives natural backpressure. The same class carries the UCX
transport's control connection (`inline_payload=False`: payloads travel elsewhere).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Sequence
from typing import Any

from kvtransfer import checksum
from kvtransfer.errors import ProtocolError
from kvtransfer.transport.base import (
    Buffer,
    Channel,
    ChannelClosed,
    ChannelHandler,
    Listener,
    PartViews,
    Transport,
)
from kvtransfer.wire import (
    PRELUDE,
    Frame,
    FrameKind,
    Hello,
    decode_frame_rest,
    decode_prelude,
    encode_frame_head,
)

log = logging.getLogger(__name__)

_PRELUDE, _REST, _CLAIM, _PAYLOAD = range(4)
_DISCARD_CHUNK = 1 << 20
_HIGH_WATER = 8 << 20
_LOW_WATER = 2 << 20

# Connection numbers are unique within a receiver process (they seed UCX tags).
_connection_numbers = itertools.count(1)


def as_byte_view(buf: Buffer) -> memoryview:
    view = buf if isinstance(buf, memoryview) else memoryview(buf)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


class FramedProtocol(asyncio.BufferedProtocol):
    """Frame codec over one TCP connection; reads payloads into views the consumer provides."""

    def __init__(self, inline_payload: bool = True):
        self.inline_payload = inline_payload
        self.transport: asyncio.Transport | None = None
        self.frames: asyncio.Queue[Frame | BaseException] = asyncio.Queue()
        self.connected: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.lost: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._state = _PRELUDE
        self._head = bytearray(PRELUDE.size)
        self._rest = bytearray()
        self._off = 0
        self._prelude: tuple[FrameKind, int, int, int] | None = None
        self._pending: Frame | None = None
        self._views: list[memoryview] = []
        self._view_idx = 0
        self._discard_left = 0
        self._discard_buf: bytearray | None = None
        self._payload_done: asyncio.Future[None] | None = None
        self._write_paused = False
        self._drain_waiters: list[asyncio.Future[None]] = []

    # --- asyncio callbacks ----------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        transport.set_write_buffer_limits(high=_HIGH_WATER, low=_LOW_WATER)
        if not self.connected.done():
            self.connected.set_result(None)

    def connection_lost(self, exc: Exception | None) -> None:
        closed = ChannelClosed(f"connection lost: {exc}" if exc else "connection closed")
        if not self.lost.done():
            self.lost.set_result(None)
        self.frames.put_nowait(closed)
        if self._payload_done is not None and not self._payload_done.done():
            self._payload_done.set_exception(closed)
        for waiter in self._drain_waiters:
            if not waiter.done():
                waiter.set_exception(closed)
        self._drain_waiters.clear()

    def pause_writing(self) -> None:
        self._write_paused = True

    def resume_writing(self) -> None:
        self._write_paused = False
        for waiter in self._drain_waiters:
            if not waiter.done():
                waiter.set_result(None)
        self._drain_waiters.clear()

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._state == _PRELUDE:
            return memoryview(self._head)[self._off :]
        if self._state == _REST:
            return memoryview(self._rest)[self._off :]
        if self._state == _PAYLOAD:
            if self._discard_left:
                assert self._discard_buf is not None
                return memoryview(self._discard_buf)[: min(self._discard_left, len(self._discard_buf))]
            return self._views[self._view_idx][self._off :]
        raise RuntimeError("read while a payload is unclaimed")  # reading is paused in _CLAIM

    def buffer_updated(self, nbytes: int) -> None:
        try:
            self._advance(nbytes)
        except ProtocolError as exc:
            log.warning("closing %s: %s", self.peer, exc)
            self.frames.put_nowait(exc)
            if self.transport is not None:
                self.transport.abort()

    def eof_received(self) -> bool:
        return False  # close our side too

    # --- reading --------------------------------------------------------------------------

    def _advance(self, nbytes: int) -> None:
        self._off += nbytes
        if self._state == _PRELUDE:
            if self._off == len(self._head):
                kind, stream, seq, body_len, num_parts = decode_prelude(self._head)
                self._prelude = (kind, stream, seq, num_parts)
                self._off = 0
                rest = 8 * num_parts + body_len
                if rest:
                    self._rest = bytearray(rest)
                    self._state = _REST
                else:
                    self._deliver(Frame(kind, stream, b"", (), seq))
        elif self._state == _REST:
            if self._off == len(self._rest):
                assert self._prelude is not None
                kind, stream, seq, num_parts = self._prelude
                self._off = 0
                self._deliver(decode_frame_rest(kind, stream, seq, num_parts, self._rest))
        elif self._state == _PAYLOAD:
            if self._discard_left:
                self._discard_left -= nbytes
                self._off = 0
                if not self._discard_left:
                    self._payload_finished()
            elif self._off == len(self._views[self._view_idx]):
                self._off = 0
                self._view_idx += 1
                if self._view_idx == len(self._views):
                    self._payload_finished()

    def _deliver(self, frame: Frame) -> None:
        if self.inline_payload and frame.payload_nbytes:
            self._state = _CLAIM
            self._pending = frame
            assert self.transport is not None
            self.transport.pause_reading()
        else:
            self._state = _PRELUDE
        self.frames.put_nowait(frame)

    def _payload_finished(self) -> None:
        self._state = _PRELUDE
        self._views = []
        done, self._payload_done = self._payload_done, None
        if done is not None and not done.done():
            done.set_result(None)

    def claim(self, frame: Frame, views: list[memoryview] | None) -> asyncio.Future[None]:
        """Land the pending frame's payload in `views` (None: discard it); resume reading."""
        if self._state != _CLAIM or frame is not self._pending:
            raise RuntimeError("claimed a payload that is not the pending one")
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        if self.lost.done():
            done.set_exception(ChannelClosed("connection closed"))
            return done
        self._pending = None
        self._payload_done = done
        self._off = 0
        self._view_idx = 0
        if views is None:
            self._discard_left = frame.payload_nbytes
            if self._discard_buf is None:
                self._discard_buf = bytearray(_DISCARD_CHUNK)
        else:
            self._discard_left = 0
            self._views = [v for v in views if len(v)]
        self._state = _PAYLOAD
        if views is not None and not self._views:
            self._payload_finished()
        assert self.transport is not None
        self.transport.resume_reading()
        return done

    @property
    def awaiting_claim(self) -> bool:
        return self._state == _CLAIM

    # --- writing --------------------------------------------------------------------------

    async def drain(self) -> None:
        if self.lost.done():
            raise ChannelClosed("connection closed")
        if self._write_paused:
            waiter = asyncio.get_running_loop().create_future()
            self._drain_waiters.append(waiter)
            await waiter

    @property
    def peer(self) -> str:
        if self.transport is None:
            return "?"
        addr = self.transport.get_extra_info("peername")
        return f"{addr[0]}:{addr[1]}" if addr else "?"


class TcpChannel(Channel):
    """Channel over one TCP connection; payload parts travel inline after their frame."""

    scatter = True

    def __init__(self, protocol: FramedProtocol):
        self._proto = protocol
        self._seq = itertools.count()

    @property
    def peer(self) -> str:
        return self._proto.peer

    @property
    def closed(self) -> bool:
        return self._proto.lost.done() or self._proto.transport is None or self._proto.transport.is_closing()

    @property
    def lost(self) -> asyncio.Future[None]:
        """Resolves when the connection is gone."""
        return self._proto.lost

    def _write_frame(self, frame: Frame) -> int:
        """Write the frame head; returns its sequence number."""
        if self.closed:
            raise ChannelClosed(f"channel to {self.peer} is closed")
        seq = next(self._seq) & 0xFFFFFFFF
        assert self._proto.transport is not None
        self._proto.transport.write(encode_frame_head(frame, seq))
        return seq

    async def send(self, frame: Frame, parts: Sequence[Buffer] = ()) -> None:
        views = [as_byte_view(p) for p in parts]
        if tuple(len(v) for v in views) != frame.part_sizes:
            raise ValueError("payload parts do not match frame.part_sizes")
        self._write_frame(frame)
        assert self._proto.transport is not None
        for view in views:
            self._proto.transport.write(view)  # the transport copies what the kernel did not take
        await self._proto.drain()

    async def recv(self) -> Frame:
        if self._proto.awaiting_claim and self._proto.frames.empty():
            raise RuntimeError("claim the previous frame's payload before reading the next frame")
        item = await self._proto.frames.get()
        if isinstance(item, BaseException):
            self._proto.frames.put_nowait(item)  # every later recv fails the same way
            raise item
        return item

    def read_payload(self, frame: Frame, parts: Sequence[PartViews]) -> asyncio.Future[None]:
        views: list[memoryview] = []
        for size, part in zip(frame.part_sizes, parts, strict=True):
            part = [as_byte_view(v) for v in part]
            if sum(len(v) for v in part) != size:
                raise ValueError(f"views hold {sum(len(v) for v in part)} B, part has {size} B")
            views.extend(part)
        return self._proto.claim(frame, views)

    def discard_payload(self, frame: Frame) -> asyncio.Future[None]:
        return self._proto.claim(frame, None)

    async def close(self) -> None:
        if self._proto.transport is not None and not self._proto.transport.is_closing():
            self._proto.transport.close()
        try:
            await asyncio.wait_for(asyncio.shield(self._proto.lost), 2.0)
        except TimeoutError:
            if self._proto.transport is not None:
                self._proto.transport.abort()


class TcpListener(Listener):
    def __init__(self, server: asyncio.AbstractServer, host: str, port: int, tasks: set[asyncio.Task[Any]]):
        self._server = server
        self.host = host
        self.port = port
        self._tasks = tasks

    async def close(self) -> None:
        self._server.close()
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=5.0)
        await self._server.wait_closed()


class TcpTransport(Transport):
    """Frames and payloads on one TCP stream per connection (asyncio)."""

    name = "tcp"
    inline_payload = True

    def _make_channel(self, protocol: FramedProtocol) -> TcpChannel:
        return TcpChannel(protocol)

    async def _hello(self, channel: TcpChannel, connection: int) -> Hello:
        return Hello(self.name, connection, checksum.supported())

    async def _on_hello(self, channel: TcpChannel, hello: Hello, timeout: float) -> TcpChannel:
        return channel

    async def listen(self, host: str, port: int, on_channel: ChannelHandler) -> TcpListener:
        await self.prepare()
        loop = asyncio.get_running_loop()
        tasks: set[asyncio.Task[Any]] = set()

        def accepted() -> FramedProtocol:
            protocol = FramedProtocol(self.inline_payload)
            task = loop.create_task(self._serve(protocol, on_channel))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            return protocol

        server = await loop.create_server(accepted, host, port)
        bound_host, bound_port = server.sockets[0].getsockname()[:2]
        log.info("%s listener on %s:%d", self.name, bound_host, bound_port)
        return TcpListener(server, bound_host, bound_port, tasks)

    async def _serve(self, protocol: FramedProtocol, on_channel: ChannelHandler) -> None:
        await protocol.connected
        channel = self._make_channel(protocol)
        try:
            hello = await self._hello(channel, next(_connection_numbers) & 0x0FFFFFFF)
            await channel.send(Frame(FrameKind.HELLO, 0, hello.encode()))
            await on_channel(channel)
        except ChannelClosed:
            pass
        except Exception:
            log.exception("KV channel from %s failed", channel.peer)
        finally:
            await channel.close()

    async def connect(self, host: str, port: int, timeout: float) -> TcpChannel:
        loop = asyncio.get_running_loop()
        try:
            _, protocol = await asyncio.wait_for(
                loop.create_connection(lambda: FramedProtocol(self.inline_payload), host, port), timeout
            )
        except TimeoutError:
            raise ChannelClosed(f"connect to {host}:{port} timed out after {timeout}s") from None
        except OSError as exc:
            raise ChannelClosed(f"connect to {host}:{port} failed: {exc}") from exc
        channel = self._make_channel(protocol)
        try:
            frame = await asyncio.wait_for(channel.recv(), timeout)
            if frame.kind != FrameKind.HELLO:
                raise ProtocolError(f"expected HELLO, got {frame.kind.name}")
            hello = Hello.decode(frame.body)
            if hello.transport != self.name:
                raise ProtocolError(f"{host}:{port} speaks transport {hello.transport!r}, not {self.name!r}")
            channel.hello = hello
            return await self._on_hello(channel, hello, timeout)
        except BaseException as exc:
            await channel.close()
            if isinstance(exc, asyncio.TimeoutError):
                raise ChannelClosed(f"no HELLO from {host}:{port} within {timeout}s") from None
            raise

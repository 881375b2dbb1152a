"""In-process transport for unit tests: frames and copied payloads between two event loops.

Lifecycle: `listen` registers the handler under a fake port in a process-wide table; `connect`
looks it up and creates a pair of channels, each bound to its own event loop (sender and
receiver may run on different threads); frames cross via `call_soon_threadsafe`. Closing one
end closes the other. `listen(...).close()` unregisters the port.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
from collections.abc import Sequence

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
from kvtransfer.transport.tcp import as_byte_view
from kvtransfer.wire import Frame, FrameKind, Hello

_ports = itertools.count(20000)
_listeners: dict[int, tuple[asyncio.AbstractEventLoop, ChannelHandler, set[LocalChannel]]] = {}
_lock = threading.Lock()
_connections = itertools.count(1)


class LocalChannel(Channel):
    """One end of an in-process pipe."""

    scatter = True

    def __init__(self, loop: asyncio.AbstractEventLoop, name: str):
        self._loop = loop
        self._name = name
        self._inbox: asyncio.Queue[tuple[Frame, list[bytes]] | ChannelClosed] = asyncio.Queue()
        self._payloads: dict[int, list[bytes]] = {}
        self._closed = False
        self.peer_channel: LocalChannel | None = None
        self._seq = itertools.count()

    @property
    def peer(self) -> str:
        return self._name

    @property
    def closed(self) -> bool:
        return self._closed

    def _deliver(self, item: tuple[Frame, list[bytes]] | ChannelClosed) -> None:
        if isinstance(item, ChannelClosed):
            self._closed = True
        self._inbox.put_nowait(item)

    async def send(self, frame: Frame, parts: Sequence[Buffer] = ()) -> None:
        if self._closed or self.peer_channel is None:
            raise ChannelClosed("local channel closed")
        data = [bytes(as_byte_view(p)) for p in parts]
        if tuple(len(d) for d in data) != frame.part_sizes:
            raise ValueError("payload parts do not match frame.part_sizes")
        stamped = Frame(frame.kind, frame.stream, frame.body, frame.part_sizes, next(self._seq) & 0xFFFFFFFF)
        peer = self.peer_channel
        try:
            peer._loop.call_soon_threadsafe(peer._deliver, (stamped, data))
        except RuntimeError:  # the peer's loop is gone
            raise ChannelClosed("local peer is gone") from None
        await asyncio.sleep(0)

    async def recv(self) -> Frame:
        item = await self._inbox.get()
        if isinstance(item, ChannelClosed):
            self._inbox.put_nowait(item)
            raise item
        frame, data = item
        if data:
            self._payloads[frame.seq] = data
        return frame

    def read_payload(self, frame: Frame, parts: Sequence[PartViews]) -> asyncio.Future[None]:
        data = self._payloads.pop(frame.seq)
        for blob, views in zip(data, parts, strict=True):
            offset = 0
            for view in views:
                view = as_byte_view(view)
                view[:] = blob[offset : offset + len(view)]
                offset += len(view)
            if offset != len(blob):
                raise ValueError(f"views hold {offset} B, part has {len(blob)} B")
        done: asyncio.Future[None] = self._loop.create_future()
        done.set_result(None)
        return done

    def discard_payload(self, frame: Frame) -> asyncio.Future[None]:
        self._payloads.pop(frame.seq, None)
        done: asyncio.Future[None] = self._loop.create_future()
        done.set_result(None)
        return done

    async def close(self) -> None:
        if self._closed:
            return
        self._deliver(ChannelClosed("local channel closed"))
        peer = self.peer_channel
        if peer is not None and not peer._loop.is_closed():
            peer._loop.call_soon_threadsafe(peer._deliver, ChannelClosed("peer closed the local channel"))


class LocalListener(Listener):
    def __init__(self, host: str, port: int):
        self.host = host
        self.port = port

    async def close(self) -> None:
        with _lock:
            entry = _listeners.pop(self.port, None)
        if entry is not None:
            for channel in list(entry[2]):
                await channel.close()


class LocalTransport(Transport):
    name = "local"

    async def listen(self, host: str, port: int, on_channel: ChannelHandler) -> LocalListener:
        with _lock:
            port = port or next(_ports)
            if port in _listeners:
                raise OSError(f"local port {port} in use")
            _listeners[port] = (asyncio.get_running_loop(), on_channel, set())
        return LocalListener(host, port)

    async def connect(self, host: str, port: int, timeout: float) -> LocalChannel:
        with _lock:
            entry = _listeners.get(port)
        if entry is None:
            raise ChannelClosed(f"no local listener on port {port}")
        server_loop, on_channel, open_channels = entry
        client = LocalChannel(asyncio.get_running_loop(), f"local:{port}")
        accepted: asyncio.Future[None] = asyncio.get_running_loop().create_future()

        def accept() -> None:
            server = LocalChannel(server_loop, "local-client")
            server.peer_channel, client.peer_channel = client, server
            open_channels.add(server)
            server_loop.create_task(self._serve(server, on_channel, open_channels))
            client._loop.call_soon_threadsafe(accepted.set_result, None)

        server_loop.call_soon_threadsafe(accept)
        await asyncio.wait_for(accepted, timeout)
        frame = await asyncio.wait_for(client.recv(), timeout)
        if frame.kind != FrameKind.HELLO or Hello.decode(frame.body).transport != self.name:
            raise ProtocolError("bad HELLO on local channel")
        client.hello = Hello.decode(frame.body)
        return client

    async def _serve(self, channel: LocalChannel, on_channel: ChannelHandler, open_channels: set[LocalChannel]) -> None:
        try:
            hello = Hello(self.name, next(_connections), checksum.supported())
            await channel.send(Frame(FrameKind.HELLO, 0, hello.encode()))
            await on_channel(channel)
        except ChannelClosed:
            pass
        finally:
            open_channels.discard(channel)
            await channel.close()

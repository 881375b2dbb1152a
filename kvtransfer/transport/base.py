"""The one small interface every KV transport implements, and `get_transport` that picks one by name.

Lifecycle: a receiver calls `Transport.listen(host, port, on_channel)`; every accepted
connection becomes a `Channel` handed to `on_channel`, which reads frames until the channel
closes. A sender calls `Transport.connect(host, port)` and keeps the channel for reuse. Both
ends close channels and listeners they own; closing is idempotent.

A channel moves ordered frames in both directions plus, for frames that carry them, payload
parts. The reader of a frame with payload must claim it (`read_payload` or `discard_payload`)
before it reads the next frame; where the bytes land is the caller's choice (views into the KV
pool), so transports that can write in place never copy.
"""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from common.plugins import KV_TRANSPORTS, resolve
from kvtransfer.wire import Frame, Hello

# Anything exposing the buffer protocol (numpy array, memoryview, bytes).
Buffer = Any
# Destination of one payload part: byte views filled in order.
PartViews = Sequence[memoryview]


class ChannelClosed(ConnectionError):
    """The channel is closed (by us or by the peer); no more frames will arrive."""


class Channel(ABC):
    """One ordered, bidirectional connection between a sender and a receiver."""

    #: Whether a payload part may be scattered over several views without a staging copy.
    scatter: bool = True
    #: The receiver's greeting, on channels opened by `Transport.connect`.
    hello: Hello | None = None

    @property
    @abstractmethod
    def peer(self) -> str:
        """Printable address of the other end (for logs)."""

    @property
    @abstractmethod
    def closed(self) -> bool: ...

    @abstractmethod
    async def send(self, frame: Frame, parts: Sequence[Buffer] = ()) -> None:
        """Send a frame and its payload parts (sizes must match `frame.part_sizes`).

        Returns when the channel can take more. The parts' memory must stay untouched until
        `flush()` returns (transports that send asynchronously keep references until then)."""

    async def flush(self) -> None:  # noqa: B027 (optional hook: synchronous transports have nothing to wait for)
        """Wait until every payload handed to `send` has left this process's buffers."""

    @abstractmethod
    async def recv(self) -> Frame:
        """Next frame from the peer; raises ChannelClosed when the connection is gone."""

    @abstractmethod
    def read_payload(self, frame: Frame, parts: Sequence[PartViews]) -> Awaitable[None]:
        """Start landing `frame`'s payload parts in `parts` (one list of views per part).

        The returned awaitable completes when every byte is in place, or raises ChannelClosed
        or a transport error. Transports may complete it after later frames were delivered."""

    @abstractmethod
    def discard_payload(self, frame: Frame) -> Awaitable[None]:
        """Consume and drop `frame`'s payload."""

    @abstractmethod
    async def close(self) -> None:
        """Close the connection; pending reads fail with ChannelClosed."""


ChannelHandler = Callable[[Channel], Awaitable[None]]


class Listener(ABC):
    """A bound server socket that turns incoming connections into channels."""

    host: str
    port: int

    @abstractmethod
    async def close(self) -> None: ...


class Transport(ABC):
    """Factory of listeners and channels for one way of moving bytes."""

    name: str

    async def prepare(self) -> None:
        """Set up on the running loop what its first connection would otherwise wait for (UCX: a context
        and worker, ~0.4 s); listeners call it before they bind, senders when their worker starts. Most
        transports have nothing to set up."""
        return

    @abstractmethod
    async def listen(self, host: str, port: int, on_channel: ChannelHandler) -> Listener: ...

    @abstractmethod
    async def connect(self, host: str, port: int, timeout: float) -> Channel: ...


def get_transport(name: str, **options: Any) -> Transport:
    """Transport by name, as registered in common/plugins.py: "ucx" (default in deployments), "tcp"
    or "local" (in-process tests). Only the chosen transport's module is imported.

    `options` go to the transport's constructor (e.g. `progress_mode` for ucx)."""
    return resolve(KV_TRANSPORTS, name, "KV transport")(**options)


async def wait_closed(channel: Channel, timeout: float) -> None:
    """Close `channel`, bounded by `timeout`."""
    try:
        await asyncio.wait_for(channel.close(), timeout)
    except (TimeoutError, OSError, ChannelClosed):
        pass

"""UCX transport (ucxx): control frames on a TCP connection, payloads as tagged UCX messages.

Lifecycle: the first listen/connect in a process initialises ucxx once (`progress_mode`,
default "blocking": the UCX worker's event fd is driven by the running asyncio loop) and binds
UCX progress to that loop. A receiver's listener is the TCP listener of `kvtransfer.transport.tcp`
whose HELLO also carries the receiver's UCX worker address; the sender creates one UCX endpoint
from that address per connection, and aborts it when the connection closes.

Each payload part is one `tag_send` with tag (connection, frame seq, part). The receiver posts a
worker-level `tag_recv` for it when it handles the frame, straight into the caller's view (the
KV pool) when the part fits one view, else into a staging buffer that is then scattered.

Why not `ucxx.create_listener`/`create_endpoint`: measured with ucxx 0.52 / UCX 1.21 on one
host, endpoints created from a socket address always use error-handling mode PEER, which UCX
serves only with tcp, not with its shared-memory (sysv/posix) or CMA transports: 0.4-0.6 GB/s.
An endpoint created from the worker address without peer error handling picks CMA zero-copy
(process_vm_readv) for rendezvous: 5-12 GB/s. Peer failure is then detected by the TCP control
connection instead (EOF/RST arrive at once), which also lets the listener bind a chosen host;
the ucxx listener binds every interface. Across hosts the same worker address selects UCX's
network transports (tcp, or RDMA/NVLink where present).
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

from kvtransfer.transport.base import Buffer, ChannelClosed, PartViews
from kvtransfer.transport.tcp import FramedProtocol, TcpChannel, TcpTransport, as_byte_view
from kvtransfer.wire import MAX_PARTS, Frame, Hello

log = logging.getLogger(__name__)

_PART_BITS = 4
_SEQ_BITS = 32
assert MAX_PARTS <= 1 << _PART_BITS

_initialised = False
_init_lock = threading.Lock()


def _ucxx() -> Any:
    os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")  # ucxx sets UCX_MEMTYPE_CACHE, unused on CPU
    import ucxx

    return ucxx


def ensure_ucx(progress_mode: str) -> Any:
    """Initialise ucxx once per process and make the running loop drive UCX progress.

    One event loop per process should talk UCX (the worker is progressed from it)."""
    global _initialised
    ucxx = _ucxx()
    with _init_lock:
        if not _initialised:
            try:
                ucxx.init(progress_mode=progress_mode)
                log.info("ucxx initialised (UCX %s), progress mode %s", ucxx.__ucx_version__, progress_mode)
            except RuntimeError:
                log.info("ucxx was already initialised in this process; keeping its progress mode")
            _initialised = True
    ucxx.continuous_ucx_progress(asyncio.get_running_loop())
    return ucxx


def payload_tag(connection: int, seq: int, part: int) -> int:
    return (connection << (_SEQ_BITS + _PART_BITS)) | (seq << _PART_BITS) | part


class UcxChannel(TcpChannel):
    """TCP control channel whose payload parts move over UCX."""

    scatter = False

    def __init__(self, protocol: FramedProtocol, ucxx: Any, window: int):
        super().__init__(protocol)
        self._ucxx = ucxx
        self._window = window
        self.connection = 0
        self._ep: Any = None
        self._inflight: set[asyncio.Task[None]] = set()
        self._send_error: BaseException | None = None

    # --- sender side ----------------------------------------------------------------------

    async def attach(self, hello: Hello, timeout: float) -> None:
        """Create the UCX endpoint to the receiver whose HELLO we got."""
        address = self._ucxx.get_ucx_address_from_buffer(hello.data_address)
        self._ep = await asyncio.wait_for(
            self._ucxx.create_endpoint_from_worker_address(address, endpoint_error_handling=False), timeout
        )
        self.connection = hello.connection
        self.lost.add_done_callback(lambda _: self._abort_endpoint())

    async def send(self, frame: Frame, parts: Sequence[Buffer] = ()) -> None:
        if self._send_error is not None:
            raise ChannelClosed(f"UCX send to {self.peer} failed: {self._send_error}")
        views = [as_byte_view(p) for p in parts]
        if tuple(len(v) for v in views) != frame.part_sizes:
            raise ValueError("payload parts do not match frame.part_sizes")
        seq = self._write_frame(frame)
        for part, view in enumerate(views):
            if len(view):
                self._start_send(view, payload_tag(self.connection, seq, part))
        await self._proto.drain()
        while len(self._inflight) >= self._window:
            await asyncio.wait(self._inflight | {self.lost}, return_when=asyncio.FIRST_COMPLETED)
            if self.lost.done():
                raise ChannelClosed(f"channel to {self.peer} closed")

    def _start_send(self, view: memoryview, tag: int) -> None:
        if self._ep is None:
            raise ChannelClosed("UCX endpoint not attached")
        task = asyncio.get_running_loop().create_task(self._ep.send(view, tag=tag, force_tag=True))
        self._inflight.add(task)
        task.add_done_callback(self._send_done)

    def _send_done(self, task: asyncio.Task[None]) -> None:
        self._inflight.discard(task)
        if not task.cancelled() and task.exception() is not None and self._send_error is None:
            self._send_error = task.exception()
            log.warning("UCX send to %s failed: %s", self.peer, self._send_error)

    async def flush(self) -> None:
        while self._inflight:
            await asyncio.wait(self._inflight | {self.lost}, return_when=asyncio.FIRST_COMPLETED)
            if self.lost.done():
                raise ChannelClosed(f"channel to {self.peer} closed")
        if self._send_error is not None:
            raise ChannelClosed(f"UCX send to {self.peer} failed: {self._send_error}")

    def _abort_endpoint(self) -> None:
        ep, self._ep = self._ep, None
        for task in list(self._inflight):
            task.cancel()
        if ep is not None:
            try:
                ep.abort(period=10**8, max_attempts=1)  # cancels sends still queued in UCX
            except Exception as exc:  # noqa: BLE001 - best effort at teardown
                log.debug("UCX endpoint abort: %s", exc)

    async def close(self) -> None:
        if self._inflight and not self.lost.done():
            try:
                await asyncio.wait_for(self.flush(), 2.0)
            except (asyncio.TimeoutError, ChannelClosed):
                pass
        await super().close()
        self._abort_endpoint()

    # --- receiver side --------------------------------------------------------------------

    def read_payload(self, frame: Frame, parts: Sequence[PartViews]) -> asyncio.Future[None]:
        recvs = []
        for part, (size, views) in enumerate(zip(frame.part_sizes, parts, strict=True)):
            views = [as_byte_view(v) for v in views]
            if sum(len(v) for v in views) != size:
                raise ValueError(f"views hold {sum(len(v) for v in views)} B, part has {size} B")
            if size:
                recvs.append(self._recv_part(payload_tag(self.connection, frame.seq, part), views, size))
        return self._until_closed(asyncio.gather(*recvs))

    def discard_payload(self, frame: Frame) -> asyncio.Future[None]:
        recvs = [
            self._recv_part(payload_tag(self.connection, frame.seq, part), None, size)
            for part, size in enumerate(frame.part_sizes)
            if size
        ]
        return self._until_closed(asyncio.gather(*recvs))

    async def _recv_part(self, tag: int, views: list[memoryview] | None, size: int) -> None:
        if views is not None and len(views) == 1:
            await self._ucxx.recv(views[0], tag=tag)
            return
        staging = np.empty(size, dtype=np.uint8)
        await self._ucxx.recv(staging, tag=tag)
        if views is not None:
            offset = 0
            for view in views:
                view[:] = staging[offset : offset + len(view)].data
                offset += len(view)

    def _until_closed(self, work: asyncio.Future[Any]) -> asyncio.Future[None]:
        """Fail with ChannelClosed when the control connection drops before `work` is done: a
        sender that is gone (or closed its endpoint) will not send the rest."""
        loop = asyncio.get_running_loop()
        done: asyncio.Future[None] = loop.create_future()

        def finish(_: Any) -> None:
            if done.done():
                return
            if work.done():
                if work.cancelled():
                    done.cancel()
                elif work.exception() is not None:
                    done.set_exception(work.exception())  # type: ignore[arg-type]
                else:
                    done.set_result(None)
            else:
                done.set_exception(ChannelClosed(f"channel to {self.peer} closed mid-payload"))

        def on_work_done(_: Any) -> None:
            self.lost.remove_done_callback(finish)
            finish(work)

        work.add_done_callback(on_work_done)
        self.lost.add_done_callback(finish)
        # Keep the UCX receive's exception retrieved even when the channel lost the race.
        work.add_done_callback(lambda f: f.cancelled() or f.exception())
        return done


class UcxTransport(TcpTransport):
    """UCX data plane (ucxx) with a TCP control connection."""

    name = "ucx"
    inline_payload = False

    def __init__(self, progress_mode: str = "blocking", window: int = 8):
        self.progress_mode = progress_mode
        self.window = window
        self._ucxx: Any = None

    def _lib(self) -> Any:
        if self._ucxx is None:
            self._ucxx = ensure_ucx(self.progress_mode)
        else:
            ensure_ucx(self.progress_mode)  # bind progress to this loop too
        return self._ucxx

    def _make_channel(self, protocol: FramedProtocol) -> UcxChannel:
        return UcxChannel(protocol, self._lib(), self.window)

    async def _hello(self, channel: TcpChannel, connection: int) -> Hello:
        assert isinstance(channel, UcxChannel)
        channel.connection = connection
        return Hello(self.name, connection, self._lib().get_worker_address().tobytes())

    async def _on_hello(self, channel: TcpChannel, hello: Hello, timeout: float) -> TcpChannel:
        assert isinstance(channel, UcxChannel)
        await channel.attach(hello, timeout)
        return channel

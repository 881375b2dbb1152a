"""UCX transport (ucxx): control frames on a TCP connection, payloads as tagged UCX messages.

Lifecycle: each event loop that talks UCX gets one `UcxWorker` (its own UCX context and worker),
created by `prepare` (a listener's loop before it binds, a KV sender's when its worker starts: the
context costs ~0.4 s, which a fresh cluster's first transfer paid on both ends) and driven by that loop; nothing else touches it, so a sender thread and a
receiver loop in one process never share UCX state. A receiver's listener is the TCP listener
of `kvtransfer.transport.tcp`, whose HELLO also carries the receiver's UCX worker address; the
sender creates one UCX endpoint from that address per connection and aborts it when the
connection closes. Each payload part is one `tag_send` tagged (connection, frame seq, part);
the receiver posts a worker-level `tag_recv` for it when it handles the frame: straight into
the caller's view (the KV pool) when the part fits one view, else into a staging buffer that is
then scattered.

Choices, measured with ucxx 0.52 / UCX 1.21 on this 2-core VM (see bench/kvtransfer.py):

* Endpoints from a socket address (`ucxx.create_listener`/`create_endpoint`) always use UCX
  peer error handling, which UCX serves only with tcp, not shared memory or CMA: 0.2-0.6 GB/s.
  An endpoint created from the worker address without peer error handling gets CMA
  (process_vm_readv, one copy) for rendezvous on one host. Peer death is detected by the TCP
  control connection instead (EOF/RST arrive at once), and the control listener binds the
  host we choose (the ucxx listener binds every interface). Across hosts the same worker
  address selects UCX's network transports.
* The price of no peer error handling: UCX crashes (SIGSEGV in `ucp_proto_rndv_send_reply`) when a
  receive matches a rendezvous request of a sender whose endpoint it already marked failed, e.g.
  the second layer of a sender SIGKILLed mid-transfer (the first one's CMA read found no process).
  So a channel posts no receive once its control connection is gone or a receive from it failed;
  it drops the connection instead, which fails that sender's transfers and nothing else.
* Which transports, per peer: the receiver's HELLO carries its `host_id()` (boot id and the
  net/IPC/PID namespace inodes). Only a sender with the same id uses the worker with every
  transport; any other uses a second worker without shared memory (`UCX_TLS=^shm`). UCX itself
  judges "same host" by the kernel alone, so between two network namespaces on one kernel
  (two pods on a node) it picked sysv/CMA, whose wake-up sockets do not cross namespaces:
  every transfer hung. Endpoint closes never block (a peer that never answers cannot stall
  the loop), and progress runs in bounded batches, so a transfer whose payload never arrives
  ends with the receiver's timeout and the control connection's drop.
* Progress: ucxx's asyncio modes busy-wait. Its "blocking" mode never re-arms the worker after
  the first event, so the loop spins on a readable fd forever after the first message, and
  `UCXRequest.wait()` polls with `asyncio.sleep(0)` while a request is outstanding: an idle
  process burns a core. `UcxWorker` is event-driven instead: progress when the worker's
  epoll fd is readable or after posting work, resolve finished requests' futures, re-arm;
  nothing runs while nothing happens (a backed-off timer guards against a missed wakeup only
  while requests are outstanding).
* Window: up to 64 payload parts (32 layers) in flight per connection. Each rendezvous message
  needs a round trip (RTS, CMA read, ATS); a small window makes the sender wait on those round
  trips, each paying the receiver's and sender's wake-up latency, which on 2 busy vCPUs is
  milliseconds.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from kvtransfer import checksum
from kvtransfer.transport.base import Buffer, ChannelClosed, PartViews
from kvtransfer.transport.tcp import (
    FramedProtocol,
    TcpChannel,
    TcpTransport,
    as_byte_view,
)
from kvtransfer.wire import MAX_PARTS, Frame, Hello

log = logging.getLogger(__name__)

_PART_BITS = 4
_SEQ_BITS = 32
# Safety net while requests are outstanding: progress at least this often (doubling up to
# _TICK_MAX_S while nothing completes), so a missed wakeup can never stall a transfer.
_TICK_MIN_S = 0.001
_TICK_MAX_S = 0.1
_PROGRESS_BATCH = 256
assert MAX_PARTS <= 1 << _PART_BITS


def _ucx_api() -> tuple[Any, Any, Any]:
    """(ucxx._lib.libucxx, Array, Tag): ucxx's low-level (Cython) API."""
    os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")  # ucxx sets UCX_MEMTYPE_CACHE, unused on CPU
    import ucxx._lib.libucxx as ucx_api
    from ucxx._lib.arr import Array
    from ucxx.types import Tag

    return ucx_api, Array, Tag


SAME_HOST = "same-host"
OTHER_HOST = "other-host"
_SCOPE_OPTIONS = {SAME_HOST: {}, OTHER_HOST: {"TLS": "^shm"}}


@functools.cache
def host_id() -> str:
    """Which kernel and namespaces this process runs in. UCX's shared-memory transports (sysv,
    posix, CMA) and their wake-up sockets need the same kernel, IPC, PID and network namespace;
    two pods on one node share the kernel (boot id) but not the namespaces."""
    try:
        parts = [Path("/proc/sys/kernel/random/boot_id").read_text().strip()]
        parts += [str(os.stat(f"/proc/self/ns/{ns}").st_ino) for ns in ("net", "ipc", "pid")]
    except OSError:
        return ""  # no /proc: never claim to share a host
    return ":".join(parts)


def peer_scope(peer_host_id: str) -> str:
    same = bool(peer_host_id) and peer_host_id == host_id()
    return SAME_HOST if same else OTHER_HOST


def payload_tag(connection: int, seq: int, part: int) -> int:
    return (connection << (_SEQ_BITS + _PART_BITS)) | (seq << _PART_BITS) | part


class UcxWorker:
    """A UCX worker driven by one asyncio loop, event-driven: no progress thread, no polling."""

    _by_loop: ClassVar[weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[str, UcxWorker]]] = (
        weakref.WeakKeyDictionary())

    def __init__(self, loop: asyncio.AbstractEventLoop, options: dict[str, str] | None = None):
        self._api, self._Array, self._Tag = _ucx_api()
        self.loop = loop
        self._context = self._api.UCXContext(options or {})
        self._worker = self._api.UCXWorker(self._context)
        self._worker.init_blocking_progress_mode()
        self._fd = self._worker.epoll_file_descriptor
        # request -> (its future, the buffer it reads or writes: kept alive until it finishes)
        self._pending: dict[Any, tuple[asyncio.Future[None], Any]] = {}
        self._scheduled = False
        self._closed = False
        self._tick: asyncio.TimerHandle | None = None
        self._tick_s = _TICK_MIN_S
        loop.add_reader(self._fd, self._progress)
        self.address: bytes = self._worker.address.tobytes()
        log.info("UCX worker ready for loop %#x", id(loop))

    @classmethod
    def for_running_loop(cls, scope: str = SAME_HOST) -> UcxWorker:
        """This loop's worker for peers in `scope`: SAME_HOST (every UCX transport) or
        OTHER_HOST (no shared-memory transports: they only work inside one host)."""
        loop = asyncio.get_running_loop()
        workers = cls._by_loop.setdefault(loop, {})
        worker = workers.get(scope)
        if worker is None or worker._closed:
            worker = workers[scope] = cls(loop, _SCOPE_OPTIONS[scope])
        return worker

    def connect(self, address: bytes) -> Any:
        """Endpoint to the worker at `address`, without peer error handling (allows CMA/shm)."""
        ep = self._api.UCXEndpoint.create_from_worker_address(
            self._worker, self._api.UCXAddress.create_from_buffer(address), False
        )
        self._kick()
        return ep

    def send(self, ep: Any, buf: memoryview, tag: int) -> asyncio.Future[None]:
        return self._track(ep.tag_send(self._Array(buf), self._Tag(tag)), buf)

    def recv(self, buf: Any, tag: int) -> asyncio.Future[None]:
        """Post a receive; raises at once when UCX failed it while posting (its rendezvous with a
        sender that is gone)."""
        request = self._worker.tag_recv(self._Array(buf), self._Tag(tag))
        if request.completed:
            request.check_error()
        return self._track(request, buf)

    def abort(self, ep: Any) -> None:
        """Start closing an endpoint; sends still queued on it are cancelled. Never blocks:
        a blocking close waits on a peer that may never answer."""
        try:
            closing = ep.close()
        except Exception as exc:  # noqa: BLE001 - best effort at teardown
            log.debug("UCX endpoint abort: %s", exc)
            return
        if closing is not None:
            self._track(closing, ep).add_done_callback(lambda f: f.cancelled() or f.exception())

    def _track(self, request: Any, buf: Any) -> asyncio.Future[None]:
        future = self.loop.create_future()
        self._pending[request] = (future, buf)
        self._kick()
        return future

    def _kick(self) -> None:
        if not self._scheduled and not self._closed:
            self._scheduled = True
            self.loop.call_soon(self._progress)

    def _progress(self) -> None:
        """Progress until idle, resolve finished requests, re-arm (or go again if busy)."""
        self._scheduled = False
        if self._closed:
            return
        for _ in range(_PROGRESS_BATCH):  # bounded: a peer that never answers must not starve the loop
            if not self._worker.progress_once():
                break
        finished = [r for r in self._pending if r.completed]
        self._tick_s = _TICK_MIN_S if finished else min(2 * self._tick_s, _TICK_MAX_S)
        for request in finished:
            future, _ = self._pending.pop(request)
            if future.done():
                continue  # abandoned by its waiter
            try:
                request.check_error()
                future.set_result(None)
            except Exception as exc:  # noqa: BLE001 - UCX reports errors as exceptions
                future.set_exception(exc)
        if not self._worker.arm():  # busy: events arrived since the last progress
            self._kick()
        elif self._pending and self._tick is None:
            self._tick = self.loop.call_later(self._tick_s, self._on_tick)

    def _on_tick(self) -> None:
        self._tick = None
        self._progress()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.loop.remove_reader(self._fd)
        if self._tick is not None:
            self._tick.cancel()
        for future, _ in self._pending.values():
            if not future.done():
                future.set_exception(ChannelClosed("UCX worker closed"))
        self._pending.clear()


class UcxChannel(TcpChannel):
    """TCP control channel whose payload parts move over UCX."""

    scatter = False

    def __init__(self, protocol: FramedProtocol, worker: UcxWorker, window: int):
        super().__init__(protocol)
        self._worker = worker
        self._window = window
        self.connection = 0
        self._ep: Any = None
        self._inflight: set[asyncio.Future[None]] = set()
        self._send_error: BaseException | None = None
        self._recv_error: BaseException | None = None

    # --- sender side ----------------------------------------------------------------------

    def attach(self, hello: Hello) -> None:
        """Create the UCX endpoint to the receiver whose HELLO we got, from the worker that
        fits where the receiver runs (same host and namespaces, or not)."""
        self._worker = UcxWorker.for_running_loop(peer_scope(hello.host_id))
        self._ep = self._worker.connect(hello.data_address)
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
        sent = self._worker.send(self._ep, view, tag)
        self._inflight.add(sent)
        sent.add_done_callback(self._send_done)

    def _send_done(self, sent: asyncio.Future[None]) -> None:
        self._inflight.discard(sent)
        if sent.cancelled() or sent.exception() is None or self._send_error is not None:
            return
        self._send_error = sent.exception()
        log.warning("UCX send to %s failed, dropping the connection: %s", self.peer, self._send_error)
        if self._proto.transport is not None:
            self._proto.transport.abort()  # the receiver sees the drop; we reconnect next time

    async def flush(self) -> None:
        while self._inflight:
            await asyncio.wait(self._inflight | {self.lost}, return_when=asyncio.FIRST_COMPLETED)
            if self.lost.done():
                raise ChannelClosed(f"channel to {self.peer} closed")
        if self._send_error is not None:
            raise ChannelClosed(f"UCX send to {self.peer} failed: {self._send_error}")

    def _abort_endpoint(self) -> None:
        ep, self._ep = self._ep, None
        if ep is not None:
            self._worker.abort(ep)  # cancels sends still queued in UCX
        for sent in list(self._inflight):
            sent.cancel()

    async def close(self) -> None:
        if self._inflight and not self.lost.done():
            try:
                await asyncio.wait_for(self.flush(), 2.0)
            except (TimeoutError, ChannelClosed):
                pass
        await super().close()
        self._abort_endpoint()

    # --- receiver side --------------------------------------------------------------------

    def read_payload(self, frame: Frame, parts: Sequence[PartViews]) -> asyncio.Future[None]:
        receives = []
        for part, (size, views) in enumerate(zip(frame.part_sizes, parts, strict=True)):
            views = [as_byte_view(v) for v in views]
            if sum(len(v) for v in views) != size:
                raise ValueError(f"views hold {sum(len(v) for v in views)} B, part has {size} B")
            if size:
                receives.append(self._recv_part(payload_tag(self.connection, frame.seq, part), views, size))
        return self._until_closed(asyncio.gather(*receives))

    def discard_payload(self, frame: Frame) -> asyncio.Future[None]:
        receives = [
            self._recv_part(payload_tag(self.connection, frame.seq, part), None, size)
            for part, size in enumerate(frame.part_sizes)
            if size
        ]
        return self._until_closed(asyncio.gather(*receives))

    def _recv_part(self, tag: int, views: list[memoryview] | None, size: int) -> asyncio.Future[None]:
        """Post the receive now (so UCX can match the message at once); scatter if staged."""
        staging = None if views is not None and len(views) == 1 else np.empty(size, dtype=np.uint8)
        received = self._post(views[0] if staging is None else staging, tag)  # type: ignore[index]
        if staging is None or views is None:
            return received
        return asyncio.ensure_future(self._scatter(received, staging, views))

    def _post(self, buf: Any, tag: int) -> asyncio.Future[None]:
        """Post one receive, unless this sender's payloads can no longer arrive. Once the control
        connection is gone, or UCX failed a receive from this sender (its rendezvous read of a dead
        process's memory), no receive is posted again: UCX would match another rendezvous request
        of that sender, and without peer error handling a reply to a failed endpoint crashes the
        process. The connection is dropped instead, which fails the sender's transfers."""
        if self._recv_error is None and self.lost.done():
            self._recv_error = ChannelClosed(f"channel to {self.peer} closed mid-payload")
        if self._recv_error is None:
            try:
                received = self._worker.recv(buf, tag)
            except Exception as exc:  # noqa: BLE001 - UCX reports errors as exceptions
                self._recv_failed(exc)
            else:
                received.add_done_callback(self._on_received)
                return received
        failed: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        failed.set_exception(ChannelClosed(f"UCX receive from {self.peer} failed: {self._recv_error}"))
        return failed

    def _on_received(self, received: asyncio.Future[None]) -> None:
        if not received.cancelled() and received.exception() is not None:
            self._recv_failed(received.exception())

    def _recv_failed(self, exc: BaseException) -> None:
        if self._recv_error is not None:
            return
        self._recv_error = exc
        log.warning("UCX receive from %s failed, dropping the connection: %s", self.peer, exc)
        if self._proto.transport is not None:
            self._proto.transport.abort()

    @staticmethod
    async def _scatter(received: asyncio.Future[None], staging: np.ndarray, views: list[memoryview]) -> None:
        await received
        offset = 0
        for view in views:
            view[:] = staging[offset : offset + len(view)].data
            offset += len(view)

    def _until_closed(self, work: asyncio.Future[Any]) -> asyncio.Future[None]:
        """Fail with ChannelClosed when the control connection drops before `work` is done: a
        sender that is gone (or closed its endpoint) will not send the rest."""
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()

        def finish(_: Any) -> None:
            if done.done():
                return
            if not work.done():
                done.set_exception(ChannelClosed(f"channel to {self.peer} closed mid-payload"))
            elif work.cancelled():
                done.cancel()
            elif work.exception() is not None:
                done.set_exception(work.exception())  # type: ignore[arg-type]
            else:
                done.set_result(None)

        def on_work_done(_: Any) -> None:
            self.lost.remove_done_callback(finish)
            finish(work)

        work.add_done_callback(on_work_done)
        work.add_done_callback(lambda f: f.cancelled() or f.exception())  # retrieved even if unobserved
        self.lost.add_done_callback(finish)
        return done


class UcxTransport(TcpTransport):
    """UCX data plane (ucxx) with a TCP control connection."""

    name = "ucx"
    inline_payload = False

    def __init__(self, window: int = 64):
        self.window = window

    async def prepare(self) -> None:
        UcxWorker.for_running_loop()

    def _make_channel(self, protocol: FramedProtocol) -> UcxChannel:
        return UcxChannel(protocol, UcxWorker.for_running_loop(), self.window)

    async def _hello(self, channel: TcpChannel, connection: int) -> Hello:
        assert isinstance(channel, UcxChannel)
        channel.connection = connection
        return Hello(self.name, connection, checksum.supported(), UcxWorker.for_running_loop().address, host_id())

    async def _on_hello(self, channel: TcpChannel, hello: Hello, timeout: float) -> TcpChannel:
        assert isinstance(channel, UcxChannel)
        channel.attach(hello)
        return channel

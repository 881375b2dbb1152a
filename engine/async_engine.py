"""Drive an Engine from asyncio: the step loop runs in its own thread, each request gets a stream.

Lifecycle: `start()` launches the loop thread; `generate()` submits a request and yields its
`RequestOutput`s as an async iterator; leaving the iterator early (client gone, task cancelled)
aborts the request in the engine and frees its blocks; `stop()` aborts everything and joins the
thread. Every engine call happens on the loop thread: other threads only enqueue commands, so the
engine itself needs no locks.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable
from typing import Any

from engine.engine import Engine, EngineStats, RequestOutput
from engine.errors import EngineError
from engine.sampling import SamplingParams

log = logging.getLogger(__name__)


class AsyncEngine:
    def __init__(self, engine: Engine):
        self.engine = engine
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._thread: threading.Thread | None = None
        self._running = False
        self._wakeup = threading.Event()

    # ---- lifecycle -----------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is not None:
            return
        self._running = True
        self._thread = threading.Thread(target=self._loop, name="pdserve-engine", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        if self._thread is None:
            return
        self._running = False
        self._wakeup.set()
        self._thread.join(timeout=30)
        self._thread = None

    # ---- requests ------------------------------------------------------------------------------
    async def generate(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, *, prefill_only: bool = False
    ) -> AsyncIterator[RequestOutput]:
        """Submit a request and stream its outputs; raises the engine's validation error up front."""
        stream = self._open_stream(request_id)
        try:
            await self.call(lambda: self.engine.add_request(request_id, prompt_token_ids, params, prefill_only=prefill_only))
        except BaseException:
            self._streams.pop(request_id, None)
            raise
        async for out in self._drain(request_id, stream):
            yield out

    async def generate_remote(self, request_id: str, stream: asyncio.Queue) -> AsyncIterator[RequestOutput]:
        """Stream outputs of a request admitted with `add_remote_request` (stream opened by `open_stream`)."""
        async for out in self._drain(request_id, stream):
            yield out

    def open_stream(self, request_id: str) -> asyncio.Queue:
        return self._open_stream(request_id)

    def close_stream(self, request_id: str) -> None:
        self._streams.pop(request_id, None)

    async def abort(self, request_id: str) -> None:
        await self.call(lambda: self.engine.abort(request_id))

    async def stats(self) -> EngineStats:
        return await self.call(self.engine.stats)

    async def call(self, fn: Callable[[], Any]) -> Any:
        """Run `fn` on the engine thread between steps and return its result."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future = loop.create_future()

        def run() -> None:
            try:
                result = fn()
            except BaseException as exc:  # delivered to the caller
                loop.call_soon_threadsafe(_set_exception, future, exc)
            else:
                loop.call_soon_threadsafe(_set_result, future, result)

        self._commands.put(run)
        self._wakeup.set()
        return await future

    # ---- internals -----------------------------------------------------------------------------
    def _open_stream(self, request_id: str) -> asyncio.Queue:
        if request_id in self._streams:
            raise EngineError(f"request {request_id!r} already has a stream")
        stream: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = (asyncio.get_running_loop(), stream)
        return stream

    async def _drain(self, request_id: str, stream: asyncio.Queue) -> AsyncIterator[RequestOutput]:
        finished = False
        try:
            while True:
                item = await stream.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self._commands.put(lambda: self.engine.abort(request_id))
                self._wakeup.set()

    def _loop(self) -> None:
        while self._running:
            self._run_commands()
            if not self.engine.has_work():
                self._wakeup.wait(timeout=0.5)
                self._wakeup.clear()
                continue
            try:
                outputs = self.engine.step()
            except Exception as exc:  # a broken step fails the requests in it, not the process
                log.exception("engine step failed")
                self._fail_all(exc)
                continue
            for out in outputs:
                self._deliver(out.request_id, out)
        self._run_commands()
        for request_id in list(self._streams):
            self.engine.abort(request_id)
        for out in self.engine.step() if self.engine.has_work() else []:
            self._deliver(out.request_id, out)

    def _run_commands(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            command()

    def _deliver(self, request_id: str, item: RequestOutput | BaseException) -> None:
        target = self._streams.get(request_id)
        if target is not None:
            loop, stream = target
            loop.call_soon_threadsafe(stream.put_nowait, item)

    def _fail_all(self, exc: Exception) -> None:
        for request_id in list(self._streams):
            self.engine.abort(request_id)
            self._deliver(request_id, EngineError(f"engine step failed: {exc}"))


def _set_result(future: asyncio.Future, result: Any) -> None:
    if not future.done():
        future.set_result(result)


def _set_exception(future: asyncio.Future, exc: BaseException) -> None:
    if not future.done():
        future.set_exception(exc)

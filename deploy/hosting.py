"""Host an asyncio server (the router's `serve`, a worker's `serve`) inside another process.

Lifecycle of a `ServerThread`: `start()` runs the server coroutine on a fresh event loop in a
daemon thread and blocks until the server called `control.ready(...)` (returns its ready info) or
failed (re-raises its error); `call(fn)` runs a coroutine function on the server's loop and returns
its result (how a Ray actor reads stats or drains); `stop()` sets `control.stop`, which makes the
server drain and return, and joins the thread. A Ray actor (deploy/actors.py) owns one of these:
its methods run in Ray's threads, the server runs undisturbed on its own loop.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from common.serving import ServerControl

log = logging.getLogger(__name__)
T = TypeVar("T")


class ServerThread:
    def __init__(self, name: str, main: Callable[[ServerControl], Awaitable[None]], handed_secret: str = ""):
        self.name = name
        self._main = main
        self.control = ServerControl(handed_secret)
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._done = threading.Event()

    @property
    def handles(self) -> dict[str, Any]:
        return self.control.handles

    def start(self, timeout_s: float = 600.0) -> dict[str, Any]:
        self._thread = threading.Thread(target=self._run, name=f"pdserve-{self.name}", daemon=True)
        self._thread.start()
        while not self.control.is_ready.wait(0.1):
            if self._done.is_set():
                raise RuntimeError(f"{self.name} failed to start: {self._error!r}") from self._error
            timeout_s -= 0.1
            if timeout_s <= 0:
                self.stop(5.0)
                raise TimeoutError(f"{self.name} was not ready in time")
        return dict(self.control.info)

    def alive(self) -> bool:
        return self._thread is not None and not self._done.is_set()

    def call(self, fn: Callable[[], Awaitable[T]], timeout_s: float | None = None) -> T:
        """Run `fn()` on the server's loop from another thread and wait for its result."""
        loop = self.control.loop
        if loop is None or self._done.is_set():
            raise RuntimeError(f"{self.name} is not running")
        return asyncio.run_coroutine_threadsafe(fn(), loop).result(timeout_s)

    def stop(self, timeout_s: float = 60.0) -> None:
        """Ask the server to drain and stop, then wait for its thread."""
        self.control.request_stop()
        if self._thread is not None:
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                log.warning("%s did not stop within %.0f s", self.name, timeout_s)

    def _run(self) -> None:
        async def main() -> None:
            self.control.bind()
            await self._main(self.control)

        try:
            asyncio.run(main())
        except BaseException as exc:  # reported by start() (before ready) or logged (after)
            self._error = exc
            if self.control.is_ready.is_set():
                log.exception("%s stopped with an error", self.name)
        finally:
            self._done.set()

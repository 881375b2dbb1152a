"""Drive an Engine from asyncio: the step loop runs in its own thread, each request gets a stream.

Lifecycle: `start()` launches the loop thread; `generate()` submits a request and yields its
`RequestOutput`s as an async iterator; leaving the iterator early (client gone, task cancelled)
aborts the request in the engine and frees its blocks; `stop()` aborts everything and joins the
thread. Every engine call happens on the loop thread: other threads only enqueue commands, so the
engine itself needs no locks.

This is the only door the workers use. A decode worker reserves blocks for a prompt whose KV comes
from elsewhere (`reserve_remote_kv`), opens its stream (`open_stream`), and once the KV has landed
`commit_remote_kv` delivers the prefill worker's first token as the stream's first output and lets
the request run (`generate_remote` streams the rest). A prefill worker runs `generate(...,
prefill_only=True)`, reads the held prompt's KV (`prompt_kv`, or layer by layer through the
`KVLayerSink` it gave the `Engine`) and frees it with `release`.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable
from typing import Any

import torch

from common.block_hash import BlockEvents
from common.errors import EngineError, RankLost
from common.sampling import SamplingParams
from engine.engine import Engine
from engine.kv_cache import KVCache, KVLayout
from engine.outputs import EngineStats, RemoteReservation, RequestOutput
from engine.parallel import TensorParallelGroup
from engine.sampler import Sample

log = logging.getLogger(__name__)


class OutputStream(asyncio.Queue):
    """One request's outputs; it ends after `sequences` finished outputs (one per sequence of the request)."""

    def __init__(self, sequences: int):
        super().__init__()
        self.sequences = sequences


class AsyncEngine:
    def __init__(self, engine: Engine, on_fatal: Callable[[Exception], None] | None = None):
        """on_fatal: called when the engine can never step again (a tensor-parallel rank exited), after
        every request in it has failed; a worker gives itself up there (common.worker.lose_worker)."""
        self._engine = engine
        self._on_fatal = on_fatal
        if engine.parallel is not None:
            engine.parallel.on_lost = lambda error: self._submit(lambda: self._fatal(error))
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, OutputStream]] = {}
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
        self._engine.close()

    # ---- what the KV transfer needs to know -----------------------------------------------------
    @property
    def layout(self) -> KVLayout:
        return self._engine.layout

    @property
    def global_layout(self) -> KVLayout:
        """The whole model's KV layout (every rank's heads under tensor parallelism)."""
        return self._engine.global_layout

    @property
    def tensor_parallel_size(self) -> int:
        return self._engine.config.tensor_parallel_size

    @property
    def ranks(self) -> TensorParallelGroup | None:
        """The engine's tensor-parallel group (None with one rank): its followers' rank agents."""
        return self._engine.parallel

    @property
    def kv_cache(self) -> KVCache:
        """The paged pool a KV receiver writes remote prompts into (blocks from `reserve_remote_kv`)."""
        return self._engine.kv_cache

    @property
    def model_config_json(self) -> str:
        return self._engine.loaded.config.to_json_string()

    # ---- requests ------------------------------------------------------------------------------
    async def generate(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, *, prefill_only: bool = False, priority: int = 0,
        reuse_cached: bool = True,
    ) -> AsyncIterator[RequestOutput]:
        """Submit a request and stream its outputs (of its n sequences, each output naming its `index`,
        until every one has finished); raises the engine's validation error up front."""
        stream = self._open_stream(request_id, 1 if prefill_only else params.n)
        try:
            await self._call(lambda: self._engine.add_request(request_id, prompt_token_ids, params, prefill_only=prefill_only,
                                                                   priority=priority, reuse_cached=reuse_cached))
        except BaseException:
            self._streams.pop(request_id, None)
            raise
        async for out in self._drain(request_id, stream):
            yield out

    async def generate_remote(self, request_id: str, stream: OutputStream) -> AsyncIterator[RequestOutput]:
        """Stream outputs of a request reserved with `reserve_remote_kv` (stream opened by `open_stream`)."""
        async for out in self._drain(request_id, stream):
            yield out

    def open_stream(self, request_id: str, n: int = 1) -> OutputStream:
        """The stream of a reserved request with `n` sequences (it ends when all n have finished)."""
        return self._open_stream(request_id, n)

    def close_stream(self, request_id: str) -> None:
        self._streams.pop(request_id, None)

    async def abort(self, request_id: str) -> None:
        await self._call(lambda: self._engine.abort(request_id))

    async def stats(self) -> EngineStats:
        return await self._call(self._engine.stats)

    # ---- KV events (the router's index of cached blocks) ---------------------------------------
    async def kv_events(self, snapshot: bool = False) -> list[BlockEvents]:
        """Blocks the prefix cache (and the second tier) stored and evicted since the last call, one BlockEvents
        per tier (or, with `snapshot` or after events were lost, every block each holds)."""
        return await self._call(lambda: self._engine.kv_events(snapshot))

    @property
    def prompt_s_per_token(self) -> float | None:
        """What a prompt token has cost this engine so far (its prompt steps' time over their prompt tokens;
        None before the first): a plain read of two counters, no engine-thread call."""
        counters = self._engine.counters
        return counters.prompt_step_seconds / counters.prompt_tokens if counters.prompt_tokens else None

    @property
    def pending_kv_events(self) -> int:
        """How many events the next `kv_events` would return (a plain read; no engine-thread call)."""
        return self._engine.num_pending_kv_events

    async def cached_block_hashes(self) -> list[int]:
        """Every block hash in the prefix cache now (does not drain events)."""
        return await self._call(self._engine.blocks.cached_hashes)

    # ---- remote prefill (decode worker) ---------------------------------------------------------
    async def reserve_remote_kv(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                                priority: int = 0) -> RemoteReservation | None:
        """Blocks to receive the prompt's KV into (its leading blocks already held are not received), or None
        when the pool (or the KV policy) has no room now."""
        return await self._call(lambda: self._engine.add_remote_request(request_id, prompt_token_ids, params, priority))

    def commit_remote_kv(self, request_id: str, first: Sample) -> None:
        """The KV has landed: `first` (sampled by the prefill worker) becomes the first output of the
        request's stream at once, and the request decodes from the next step on (the commit is queued
        before that step; nothing waits for the step boundary)."""
        self._deliver(request_id, self._engine.accept_first_token(request_id, first))
        self._submit(lambda: self._engine.commit_remote_kv(request_id))

    # ---- prefill-only requests (prefill worker) -------------------------------------------------
    async def prompt_kv(self, request_id: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Every layer's K and V of a held prefill-only request's prompt (copies)."""
        return await self._call(lambda: self._engine.prompt_kv(request_id))

    async def hold_prefix(self, request_id: str, token_ids: list[int]) -> bool:
        """Pin a cached prefix for reading (`prompt_kv`) until `release`; False: not all of it is cached."""
        return await self._call(lambda: self._engine.hold_prefix(request_id, token_ids))

    async def cache_received(self, request_id: str) -> None:
        """A pulled prefix (reserved with `reserve_remote_kv`) landed: publish it in the prefix cache."""
        await self._call(lambda: self._engine.cache_received(request_id))

    async def release(self, request_id: str) -> None:
        """Free a prefill-only request's blocks (its KV was sent, or the call failed). Aborts it first:
        a call cancelled while its `generate` waited for the engine thread leaves a request to run."""

        def release() -> None:
            self._engine.abort(request_id)
            self._engine.release(request_id)

        await self._call(release)

    # ---- internals -----------------------------------------------------------------------------
    async def _call(self, fn: Callable[[], Any]) -> Any:
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

    def _open_stream(self, request_id: str, n: int) -> OutputStream:
        if request_id in self._streams:
            raise EngineError(f"request {request_id!r} already has a stream")
        stream = OutputStream(n)
        self._streams[request_id] = (asyncio.get_running_loop(), stream)
        return stream

    async def _drain(self, request_id: str, stream: OutputStream) -> AsyncIterator[RequestOutput]:
        finished = False
        live = stream.sequences
        try:
            while True:
                item = await stream.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                live -= item.finished
                if not live:
                    finished = True
                    return
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self._submit(lambda: self._engine.abort(request_id))

    def _loop(self) -> None:
        while self._running:
            self._run_commands()
            if not self._engine.has_work():
                self._wakeup.wait(timeout=0.5)
                self._wakeup.clear()
                continue
            try:
                outputs = self._engine.step()
            except RankLost as exc:
                self._fatal(exc)
                continue
            except Exception as exc:  # a broken step fails the requests in it, not the process
                log.exception("engine step failed")
                self._fail_all(exc)
                continue
            for out in outputs:
                self._deliver(out.request_id, out)
        self._run_commands()
        for request_id in list(self._streams):
            self._engine.abort(request_id)
        for out in self._engine.step() if self._engine.has_work() else []:
            self._deliver(out.request_id, out)

    def _submit(self, command: Callable[[], None]) -> None:
        """Queue `command` for the engine thread's next step boundary without waiting for it."""
        self._commands.put(command)
        self._wakeup.set()

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

    def _fatal(self, exc: Exception) -> None:
        self._fail_all(exc)
        if self._on_fatal is not None:
            self._on_fatal(exc)

    def _fail_all(self, exc: Exception) -> None:
        for request_id in list(self._streams):
            self._engine.abort(request_id)
            self._deliver(request_id, EngineError(f"engine step failed: {exc}"))


def _set_result(future: asyncio.Future, result: Any) -> None:
    if not future.done():
        future.set_result(result)


def _set_exception(future: asyncio.Future, exc: BaseException) -> None:
    if not future.done():
        future.set_exception(exc)

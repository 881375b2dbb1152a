"""UCX tag sends of the 60 K/V buffers between two processes, with no protocol and no checksum, in
one of RAW_UCX_MODES (kvtransfer's event-driven UcxWorker, or ucxx's asyncio API two ways)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from bench.kvmethods.base import ACK_TAG, BYTES_PER_TOKEN, HEAD_TAG, PART_TAG, Method, layer_buffers, reap, recv_reply, spawn

RAW_UCX_MODES = {
    "ucx_raw": "worker address, no peer error handling, kvtransfer's event-driven UcxWorker",
    "ucx_raw_ucxx_asyncio": "worker address, no peer error handling, ucxx asyncio API (blocking progress mode)",
    "ucx_raw_sockaddr": "ucxx.create_listener/create_endpoint (peer error handling on), ucxx asyncio API",
}


class _RawUcx:
    """One side of a raw UCX run in one of RAW_UCX_MODES."""

    def __init__(self, mode: str):
        os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
        self.mode = mode
        self.ep: Any = None
        if mode == "ucx_raw":
            from kvtransfer.transport.ucx import UcxWorker

            self.worker = UcxWorker.for_running_loop()
        else:
            import ucxx

            self.ucxx = ucxx
            with contextlib.suppress(RuntimeError):  # already initialised in this process
                ucxx.init(progress_mode="blocking")
            ucxx.continuous_ucx_progress()

    def address(self) -> bytes:
        return self.worker.address if self.mode == "ucx_raw" else self.ucxx.get_worker_address().tobytes()

    async def connect(self, hello: Any) -> None:
        if self.mode == "ucx_raw":
            self.ep = self.worker.connect(hello)
        elif self.mode == "ucx_raw_ucxx_asyncio":
            address = self.ucxx.get_ucx_address_from_buffer(hello)
            self.ep = await self.ucxx.create_endpoint_from_worker_address(address, endpoint_error_handling=False)
        else:
            self.ep = await self.ucxx.create_endpoint("127.0.0.1", hello, endpoint_error_handling=True)

    def send(self, buf: np.ndarray, tag: int) -> Any:
        if self.mode == "ucx_raw":
            return self.worker.send(self.ep, memoryview(buf).cast("B"), tag)
        if self.mode == "ucx_raw_ucxx_asyncio":
            return self.ep.send(buf, tag=tag, force_tag=True)
        return self.ep.send(buf, tag=tag)

    def recv(self, buf: np.ndarray, tag: int) -> Any:
        if self.mode == "ucx_raw":
            return self.worker.recv(memoryview(buf).cast("B"), tag)
        if self.mode == "ucx_raw_ucxx_asyncio":
            return self.ucxx.recv(buf, tag=tag)
        return self.ep.recv(buf, tag=tag)

    def close(self) -> None:
        if self.ep is not None:
            if self.mode == "ucx_raw":
                self.worker.abort(self.ep)
            else:
                self.ep.abort()


def _ucx_sink(conn: Connection, max_bytes: int, mode: str) -> None:
    """Child: per transfer a header (count, part size), then `count` tagged parts into one
    preallocated buffer, then a 1-byte ack back over UCX. Ends on count 0."""

    async def receive_all(side: _RawUcx) -> None:
        buf = np.empty(max_bytes, dtype=np.uint8)
        head = np.empty(2, dtype=np.uint64)
        ack = np.ones(1, dtype=np.uint8)
        while True:
            await side.recv(head, HEAD_TAG)
            count, part = int(head[0]), int(head[1])
            if count == 0:
                return
            await asyncio.gather(*(side.recv(buf[i * part : (i + 1) * part], PART_TAG) for i in range(count)))
            await side.send(ack, ACK_TAG)

    async def serve() -> None:
        side = _RawUcx(mode)
        if mode == "ucx_raw_sockaddr":
            done = asyncio.Event()

            async def on_endpoint(ep: Any) -> None:
                side.ep = ep
                await receive_all(side)
                done.set()

            listener = side.ucxx.create_listener(on_endpoint, endpoint_error_handling=True)
            conn.send(listener.port)
            await done.wait()
            listener.close()
        else:
            conn.send(side.address())
            await side.connect(await asyncio.to_thread(conn.recv))  # the source, for acks
            await receive_all(side)
        side.close()

    asyncio.run(serve())


def _ucx_source(conn: Connection, mode: str, tokens: list[int]) -> None:
    """Child: per "run n", send the 60 buffers of n tokens (all in flight) and await the ack."""

    async def serve() -> None:
        side = _RawUcx(mode)
        conn.send(side.address() if mode != "ucx_raw_sockaddr" else b"")
        await side.connect(await asyncio.to_thread(conn.recv))
        data = {n: layer_buffers(n) for n in tokens}
        ack = np.empty(1, dtype=np.uint8)
        conn.send("ready")
        while True:
            command = await asyncio.to_thread(conn.recv)
            if command[0] == "idle_cpu":
                cpu = time.process_time()
                await asyncio.sleep(1.0)
                conn.send(round(100 * (time.process_time() - cpu), 1))
                continue
            if command[0] != "run":
                break
            bufs = data[command[1]]
            t = time.perf_counter()
            acked = side.recv(ack, ACK_TAG)
            await side.send(np.array([len(bufs), bufs[0].nbytes], dtype=np.uint64), HEAD_TAG)
            await asyncio.gather(*(side.send(b, PART_TAG) for b in bufs))
            await acked
            conn.send(time.perf_counter() - t)
        await side.send(np.zeros(2, dtype=np.uint64), HEAD_TAG)
        await asyncio.sleep(0.2)
        side.close()

    asyncio.run(serve())


class RawUcxMethod(Method):
    def __init__(self, mode: str, tokens: list[int]):
        self.mode = mode
        self.keys = (mode,)
        self.tokens = tokens

    def launch(self) -> None:
        self.sink, self.sink_conn = spawn(_ucx_sink, max(self.tokens) * BYTES_PER_TOKEN, self.mode)
        self.source, self.conn = spawn(_ucx_source, self.mode, self.tokens)

    def wait_ready(self, timeout: float) -> None:
        sink_hello = recv_reply(self.sink_conn, timeout)
        source_address = recv_reply(self.conn, timeout)
        if self.mode != "ucx_raw_sockaddr":
            self.sink_conn.send(source_address)
        self.conn.send(sink_hello)
        recv_reply(self.conn, timeout)

    def run(self, num_tokens: int, warmup: bool) -> dict[str, tuple[float, float | None]]:
        self.conn.send(("run", num_tokens))
        return {self.mode: (recv_reply(self.conn, 120), None)}

    def extras(self) -> dict[str, Any]:
        self.conn.send(("idle_cpu",))
        return {"idle_cpu_percent": recv_reply(self.conn, 30)}

    def stop(self) -> None:
        reap([self.source, self.sink], [self.conn])

"""The baseline: a plain blocking TCP socket between two processes (sendall the 60 K/V buffers,
recv_into one preallocated buffer, 1-byte ack; no framing, no checksum)."""

from __future__ import annotations

import socket
import struct
import time
from multiprocessing.connection import Connection

import numpy as np

from bench.kvmethods.base import BYTES_PER_TOKEN, Method, layer_buffers, reap, recv_reply, spawn


def _socket_sink(conn: Connection, max_bytes: int) -> None:
    """Child: accept one connection; per transfer read an 8-byte length, recv_into, ack."""
    server = socket.create_server(("127.0.0.1", 0))
    conn.send(server.getsockname()[1])
    sock, _ = server.accept()
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    buf = memoryview(np.empty(max_bytes, dtype=np.uint8))
    head = bytearray(8)
    try:
        while sock.recv_into(head, 8, socket.MSG_WAITALL) == 8:
            (total,) = struct.unpack("!Q", head)
            if total == 0:
                break
            got = 0
            while got < total:
                n = sock.recv_into(buf[got:total])
                if n == 0:
                    return
                got += n
            sock.sendall(b"k")
    finally:
        sock.close()
        server.close()


def _socket_source(conn: Connection, port: int, tokens: list[int]) -> None:
    """Child: per "run n", sendall the 60 buffers of n tokens and wait for the ack."""
    data = {n: layer_buffers(n) for n in tokens}
    sock = socket.create_connection(("127.0.0.1", port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    ack = bytearray(1)
    conn.send("ready")
    while (command := conn.recv())[0] == "run":
        bufs = data[command[1]]
        t = time.perf_counter()
        sock.sendall(struct.pack("!Q", sum(b.nbytes for b in bufs)))
        for b in bufs:
            sock.sendall(memoryview(b))
        sock.recv_into(ack, 1)
        conn.send(time.perf_counter() - t)
    sock.sendall(struct.pack("!Q", 0))
    sock.close()


class SocketMethod(Method):
    keys = ("socket_blocking",)

    def __init__(self, tokens: list[int]):
        self.tokens = tokens

    def launch(self) -> None:
        self.sink, self.sink_conn = spawn(_socket_sink, max(self.tokens) * BYTES_PER_TOKEN)

    def wait_ready(self, timeout: float) -> None:
        port = recv_reply(self.sink_conn, timeout)
        self.source, self.conn = spawn(_socket_source, port, self.tokens)
        recv_reply(self.conn, timeout)

    def run(self, num_tokens: int, warmup: bool) -> dict[str, tuple[float, float | None]]:
        self.conn.send(("run", num_tokens))
        return {"socket_blocking": (recv_reply(self.conn, 120), None)}

    def stop(self) -> None:
        reap([self.source, self.sink], [self.conn])

"""KV shapes and buffers of the transfer benchmark, result summaries, the `Method` interface with its
child-process plumbing (spawn, reply, reap), and `measure`: launch every method, run round-robin
over sizes and methods (round r starts at a rotating method, so load from other work spreads over
all of them alike), stop them, and summarize the best and median of the rounds after a warm-up."""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import statistics
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

log = logging.getLogger("bench.kvtransfer")

LAYERS, HEADS, HEAD_DIM, ELEM = 30, 3, 64, 4
BYTES_PER_TOKEN = 2 * LAYERS * HEADS * HEAD_DIM * ELEM  # 46080
ACK_TAG, HEAD_TAG, PART_TAG = 3, 1, 2


def layer_buffers(num_tokens: int) -> list[np.ndarray]:
    """60 buffers (K and V per layer) of random bytes, as a sender would hold them."""
    rng = np.random.default_rng(num_tokens)
    per = num_tokens * HEADS * HEAD_DIM * ELEM
    return [rng.integers(0, 256, per, dtype=np.uint8) for _ in range(2 * LAYERS)]


def summarize(nbytes: int, seconds: list[float]) -> dict[str, float]:
    best = min(seconds)
    return {
        "bytes": nbytes,
        "seconds_best": round(best, 6),
        "gbps_best": round(nbytes / best / 1e9, 3),
        "gbps_median": round(nbytes / statistics.median(seconds) / 1e9, 3),
    }


def timed(fn: Callable[[], Any]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


class Method:
    """A pair of children (source, sink) measured one transfer at a time."""

    keys: tuple[str, ...]

    def launch(self) -> None: ...

    def wait_ready(self, timeout: float) -> None: ...

    def run(self, num_tokens: int, warmup: bool) -> dict[str, tuple[float, float | None]]:
        """One transfer per key: {key: (sender seconds, receiver seconds or None)}."""
        raise NotImplementedError

    def extras(self) -> dict[str, Any]:
        return {}

    def stop(self) -> None: ...


def spawn(target: Callable[..., None], *args: Any) -> tuple[mp.Process, Connection]:
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=target, args=(child, *args), daemon=True)
    proc.start()
    child.close()
    return proc, parent


def recv_reply(conn: Connection, timeout: float) -> Any:
    if not conn.poll(timeout):
        raise TimeoutError(f"bench child did not answer within {timeout}s")
    reply = conn.recv()
    if isinstance(reply, tuple) and reply and reply[0] == "error":
        raise RuntimeError(f"bench child failed: {reply[1]}")
    return reply


def reap(procs: list[mp.Process], conns: list[Connection]) -> None:
    for conn in conns:
        with contextlib.suppress(OSError):
            conn.send(("stop",))
    for proc in procs:
        proc.join(15)
        if proc.is_alive():
            proc.kill()
            proc.join(5)


def measure(methods: list[Method], tokens: list[int], repeats: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """Round-robin over sizes and methods; returns (results by key and size, extras by key)."""
    sender_s: dict[str, dict[int, list[float]]] = {}
    receiver_s: dict[str, dict[int, list[float]]] = {}
    try:
        for method in methods:
            method.launch()
        for method in methods:
            method.wait_ready(180)
        for rnd in range(repeats + 1):
            log.info("round %d/%d", rnd, repeats)
            for n in tokens:
                for i in range(len(methods)):
                    method = methods[(i + rnd) % len(methods)]
                    for key, (sent, received) in method.run(n, warmup=rnd == 0).items():
                        if rnd == 0:
                            continue
                        sender_s.setdefault(key, {}).setdefault(n, []).append(sent)
                        if received is not None:
                            receiver_s.setdefault(key, {}).setdefault(n, []).append(received)
        extras = {}
        for method in methods:
            if found := method.extras():
                extras[method.keys[0]] = found
    finally:
        for method in methods:
            with contextlib.suppress(Exception):
                method.stop()
    results: dict[str, Any] = {}
    for key, by_size in sender_s.items():
        results[key] = {}
        for n, times in by_size.items():
            summary = summarize(n * BYTES_PER_TOKEN, times)
            if key in receiver_s:
                summary["receiver_gbps_best"] = round(n * BYTES_PER_TOKEN / min(receiver_s[key][n]) / 1e9, 3)
            results[key][str(n)] = summary
    return results, extras

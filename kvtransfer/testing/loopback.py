"""A KV receiver or sender in a child process, driven over a pipe: the two-process harness
behind the integration tests and `bench/kvtransfer.py`.

Lifecycle: `Peer("receiver" | "sender", spec).start()` spawns a child (multiprocessing
"spawn", so no state leaks from the parent), which applies `spec.env` (a sender reads its
`PDSERVE_KV_FAULTS` from it once, at start), builds its side (a
receiver child runs one KVReceiver per transport in `spec.transports`, all into one pool),
answers "ready" (a receiver with {transport: endpoint}) and serves commands until "stop".
Every wait has a timeout; `stop()` escalates to kill, and `kill()` is SIGKILL (peer death).

Source KV is generated from a seed, so a receiver's crc over what landed in its blocks can be
compared with the sender's crc over what it sent (`kv_crc`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import multiprocessing as mp
import os
import time
import zlib
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any, Self

import torch

from engine.kv_cache import KVCache, KVLayout
from kvtransfer.buffers import tensor_bytes
from kvtransfer.errors import KVTransferError
from kvtransfer.faults import FaultInjector
from kvtransfer.receiver import KVReceiver
from kvtransfer.sender import KVSender, OutgoingTransfer
from kvtransfer.wire import TransferHeader, fingerprint

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PeerSpec:
    """Everything a child needs to build its side; picklable."""

    transports: tuple[str, ...] = ("tcp",)
    num_layers: int = 30
    num_kv_heads: int = 3
    head_dim: int = 64
    block_size: int = 16
    dtype: str = "float32"
    num_blocks: int = 64
    model_config_json: str = json.dumps({"model_type": "llama", "name": "SmolLM2-135M"})
    env: dict[str, str] = field(default_factory=dict)
    transport_options: dict[str, dict[str, Any]] = field(default_factory=dict)  # per transport name
    zero_copy: bool = True

    @property
    def layout(self) -> KVLayout:
        return KVLayout(self.num_layers, self.num_kv_heads, self.head_dim, self.block_size, getattr(torch, self.dtype))

    @property
    def fingerprint(self) -> str:
        return fingerprint(self.layout, self.model_config_json)


class PeerError(RuntimeError):
    """The child reported an exception for a command (type name and message preserved)."""

    def __init__(self, kind: str, message: str):
        super().__init__(f"{kind}: {message}")
        self.kind = kind


def source_kv(spec: PeerSpec, num_tokens: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Deterministic K/V `[num_tokens, heads, dim]` per layer."""
    gen = torch.Generator().manual_seed(seed)
    shape = (num_tokens, spec.num_kv_heads, spec.head_dim)
    dtype = getattr(torch, spec.dtype)
    return [
        (torch.rand(shape, generator=gen).to(dtype), torch.rand(shape, generator=gen).to(dtype))
        for _ in range(spec.num_layers)
    ]


def kv_crc(layers: list[tuple[torch.Tensor, torch.Tensor]]) -> int:
    crc = 0
    for k, v in layers:
        crc = zlib.crc32(tensor_bytes(v), zlib.crc32(tensor_bytes(k), crc))
    return crc


class Peer:
    """Parent-side handle of one child process."""

    def __init__(self, role: str, spec: PeerSpec):
        if role not in ("receiver", "sender"):
            raise ValueError(f"role must be receiver or sender, not {role!r}")
        self.role = role
        self.spec = spec
        ctx = mp.get_context("spawn")
        self._conn, child_conn = ctx.Pipe()
        self._proc = ctx.Process(target=_child_main, args=(role, spec, child_conn), name=f"kv-{role}", daemon=True)
        self._child_conn = child_conn
        self._stopping = False
        self.ready: Any = None

    @property
    def pid(self) -> int | None:
        return self._proc.pid

    @property
    def alive(self) -> bool:
        return self._proc.is_alive()

    def launch(self) -> None:
        """Spawn the child without waiting for it (see `start_all`)."""
        self._proc.start()
        self._child_conn.close()

    def start(self, timeout: float = 60.0) -> Any:
        """Spawn the child and wait until it is ready; returns its ready payload."""
        self.launch()
        self.ready = self.wait_reply(timeout)
        return self.ready

    @staticmethod
    def start_all(peers: list[Peer], timeout: float = 90.0) -> None:
        """Spawn several children at once (their imports overlap) and wait for all."""
        for peer in peers:
            peer.launch()
        deadline = time.monotonic() + timeout
        for peer in peers:
            peer.ready = peer.wait_reply(max(0.0, deadline - time.monotonic()))

    @staticmethod
    def stop_all(peers: list[Peer], timeout: float = 15.0) -> None:
        """Ask every live child to stop, then reap them all (killing stragglers)."""
        for peer in peers:
            if peer.alive:
                try:
                    peer.post("stop")
                except OSError:
                    pass
        for peer in peers:
            peer.stop(timeout)

    def post(self, *command: Any) -> None:
        self._stopping = self._stopping or command[0] == "stop"
        self._conn.send(command)

    def wait_reply(self, timeout: float) -> Any:
        if not self._conn.poll(timeout):
            raise TimeoutError(f"{self.role} did not answer within {timeout}s")
        try:
            status, payload = self._conn.recv()
        except EOFError:
            raise PeerError("EOFError", f"{self.role} (pid {self.pid}) exited") from None
        if status == "error":
            raise PeerError(*payload)
        return payload

    def call(self, *command: Any, timeout: float = 60.0) -> Any:
        self.post(*command)
        return self.wait_reply(timeout)

    def kill(self) -> None:
        if self._proc.is_alive():
            self._proc.kill()
        self._proc.join(10)

    def stop(self, timeout: float = 15.0) -> None:
        if self._proc.is_alive():
            try:
                if not self._stopping:
                    self.post("stop")
                self.wait_reply(timeout)
            except (TimeoutError, EOFError, OSError, PeerError):
                pass
            self._proc.join(timeout)
        if self._proc.is_alive():
            self.kill()
        self._conn.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


# --- child side ----------------------------------------------------------------------------


def _child_main(role: str, spec: PeerSpec, conn: Connection) -> None:
    os.environ.update(spec.env)
    logging.basicConfig(level=os.environ.get("PDSERVE_LOG_LEVEL", "WARNING"), format=f"[{role} %(process)d] %(name)s %(levelname)s %(message)s")
    torch.set_num_threads(1)
    try:
        if role == "receiver":
            asyncio.run(_ReceiverChild(spec, conn).serve())
        else:
            _SenderChild(spec, conn).serve()
    except Exception as exc:
        with contextlib.suppress(OSError):
            _reply_error(conn, exc)  # e.g. a failed start: the parent sees why
        raise
    finally:
        conn.close()


def _reply_error(conn: Connection, exc: BaseException) -> None:
    conn.send(("error", (type(exc).__name__, str(exc))))


class _ReceiverChild:
    def __init__(self, spec: PeerSpec, conn: Connection):
        self.spec = spec
        self.conn = conn
        self.cache = KVCache(spec.layout, spec.num_blocks)
        self.receivers: dict[str, KVReceiver] = {}
        self.futures: dict[str, tuple[asyncio.Future[Any], list[int], float]] = {}

    async def serve(self) -> None:
        for name in self.spec.transports:
            options = self.spec.transport_options.get(name, {})
            self.receivers[name] = KVReceiver(self.cache, name, zero_copy=self.spec.zero_copy, **options)
        endpoints = {name: await receiver.start() for name, receiver in self.receivers.items()}
        self.conn.send(("ok", endpoints))
        try:
            while True:
                command = await asyncio.to_thread(self.conn.recv)
                if command[0] == "stop":
                    break
                try:
                    self.conn.send(("ok", await self.handle(*command)))
                except Exception as exc:  # noqa: BLE001 - reported to the parent
                    _reply_error(self.conn, exc)
        finally:
            for receiver in self.receivers.values():
                await receiver.close()
            for fut, _, _ in self.futures.values():  # never asked for: not an error
                if fut.done() and not fut.cancelled():
                    fut.exception()
            self.conn.send(("ok", None))

    async def handle(self, name: str, *args: Any) -> Any:
        if name == "expect":
            transport, tid, block_ids, num_tokens, timeout = args
            fut = self.receivers[transport].expect(tid, block_ids, num_tokens, self.spec.fingerprint, timeout)
            self.futures[tid] = (fut, block_ids, time.monotonic())
            return None
        if name == "result":
            tid, timeout, *rest = args
            verify = rest[0] if rest else True
            fut, block_ids, expected_at = self.futures.pop(tid)
            try:
                received = await asyncio.wait_for(asyncio.shield(fut), timeout)
            except KVTransferError as exc:
                return {"ok": False, "error": type(exc).__name__, "message": str(exc), "elapsed_s": time.monotonic() - expected_at}
            outcome = {"ok": True, "first_token": received.first_token, "transfer_s": received.transfer_s}
            if verify:
                layers = [self.cache.read_tokens(i, block_ids, received.num_tokens) for i in range(self.spec.num_layers)]
                outcome["kv_crc"] = kv_crc(layers)
            return outcome
        if name == "stats":
            return {
                transport: {
                    "bytes_received": r.stats.bytes_received,
                    "layers_landed": r.stats.layers_landed,
                    "completed": r.stats.completed,
                    "failed": dict(r.stats.failed),
                    "pending": r.pending,
                }
                for transport, r in self.receivers.items()
            }
        raise ValueError(f"unknown receiver command {name!r}")


class _SenderChild:
    def __init__(self, spec: PeerSpec, conn: Connection):
        self.spec = spec
        self.conn = conn
        self.data: dict[tuple[int, int], list[tuple[torch.Tensor, torch.Tensor]]] = {}

    def serve(self) -> None:
        sender = KVSender(transport_options=self.spec.transport_options, faults=FaultInjector.from_env())
        self.conn.send(("ok", os.getpid()))
        try:
            while True:
                command = self.conn.recv()
                if command[0] == "stop":
                    break
                try:
                    self.conn.send(("ok", self.handle(sender, *command)))
                except Exception as exc:  # noqa: BLE001 - reported to the parent
                    _reply_error(self.conn, exc)
        finally:
            sender.close()
            self.conn.send(("ok", None))

    def source(self, num_tokens: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        if (num_tokens, seed) not in self.data:
            self.data[(num_tokens, seed)] = source_kv(self.spec, num_tokens, seed)
        return self.data[(num_tokens, seed)]

    def handle(self, sender: KVSender, name: str, *args: Any) -> Any:
        if name == "prepare":
            num_tokens, seed = args
            self.source(num_tokens, seed)
            return None
        if name == "send":
            (plans,) = args  # list of dicts: endpoint, tid, num_tokens, seed, first_token, layer_delay_s
            return self.send(sender, plans)
        raise ValueError(f"unknown sender command {name!r}")

    def send(self, sender: KVSender, plans: list[dict[str, Any]]) -> dict[str, Any]:
        """Start every plan's transfer, feed layers round-robin (like one prefill batch), and
        wait for all acks. Returns {"transfers": [per-plan outcome], "wall_s": seconds}."""
        started = time.perf_counter()
        xfers: list[tuple[dict[str, Any], OutgoingTransfer]] = []
        for plan in plans:
            header = TransferHeader.for_layout(plan["tid"], self.spec.layout, plan["num_tokens"], plan.get("fingerprint", self.spec.fingerprint))
            xfers.append((plan, sender.begin(plan["endpoint"], header)))
        for layer in range(self.spec.num_layers):
            for plan, xfer in xfers:
                k, v = self.source(plan["num_tokens"], plan["seed"])[layer]
                xfer.send_layer(layer, k, v)
            delay = max(p.get("layer_delay_s", 0.0) for p in plans)
            if delay:
                time.sleep(delay)
        for plan, xfer in xfers:
            xfer.finish(plan.get("first_token", 0))
        results = []
        for plan, xfer in xfers:
            try:
                ack = xfer.result(timeout=plan.get("timeout", 60.0))
                outcome = {"ok": True, "duration_s": ack.duration_s, "nbytes": ack.nbytes}
                if plan.get("verify", True):
                    outcome["kv_crc"] = kv_crc(self.source(plan["num_tokens"], plan["seed"]))
                results.append(outcome)
            except KVTransferError as exc:
                results.append({"ok": False, "error": type(exc).__name__, "message": str(exc)})
        return {"transfers": results, "wall_s": time.perf_counter() - started}

"""Rank 0's side of a tensor-parallel group: start the followers, run steps on every rank, talk to
the followers' rank agents, stop them.

The channel to each follower is a local socket (`multiprocessing.connection`, authenticated with a
per-group key): a TP group always sits on one node (one placement group bundle per rank,
STRICT_PACK), and a plain socket has no timeout to trip over while the engine idles. Tensors move
over the torch.distributed group that `join` sets up. A reader thread per follower takes its
replies; a follower whose channel closes is lost, and so is the group: pending asks fail and the
next step raises RankLost.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
import logging
import multiprocessing
import os
import secrets
import threading
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from multiprocessing.connection import Connection, Listener
from typing import Any, Protocol

import torch
import torch.distributed as dist

from common.engine_config import EngineConfig
from common.errors import RankLost
from engine.kv_sink import SinkRequest
from engine.model_loader import check_tensor_parallel
from engine.model_runner import ModelRunner
from engine.parallel.messages import STOP, Call, Reply, Step
from engine.step import StepItem

log = logging.getLogger(__name__)

COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=5)
"""How long one collective may wait for a peer before it fails (a rank that hangs, not one that dies:
a dead peer's closed connection fails the collective at once)."""


@dataclass(frozen=True)
class RankInfo:
    rank: int
    world_size: int
    store_port: int
    """The torch.distributed rendezvous: rank 0's TCPStore on 127.0.0.1 (the ranks share a node)."""
    steps_address: tuple[str, int]
    authkey: bytes
    agent: tuple[str, Any] | None = None
    """("module:function", settings): what builds each follower's rank agent
    (engine.parallel.follower.RankAgent), called with (runtime, rank, engine config, settings)."""

    def device(self, configured: str) -> str:
        """One GPU per rank: rank r uses cuda:r of its node, or cuda:0 where it sees one GPU only (a
        rank placed by Ray, which gives each bundle's process its own GPU); CPU ranks share the CPU."""
        if torch.device(configured).type != "cuda":
            return configured
        return f"cuda:{self.rank}" if torch.cuda.device_count() > self.rank else "cuda:0"


class RankHandle(Protocol):
    def is_alive(self) -> bool: ...

    def kill(self) -> None: ...

    def join(self, timeout: float | None = None) -> None: ...


class RankLauncher(Protocol):
    """Starts follower rank processes: `launch` runs engine.parallel.follower.serve_rank(config, info)
    somewhere on rank 0's node and returns a handle on it."""

    def launch(self, config: EngineConfig, info: RankInfo) -> RankHandle: ...


class LocalRanks:
    """Followers as child processes of rank 0 (plain processes, `pdserve generate --local`)."""

    def launch(self, config: EngineConfig, info: RankInfo) -> RankHandle:
        from engine.parallel.follower import serve_rank

        process = multiprocessing.get_context("spawn").Process(target=serve_rank, args=(config, info),
                                                                name=f"pdserve-tp-rank{info.rank}", daemon=True)
        process.start()
        return process


def join(info: RankInfo, device: str, store: dist.TCPStore | None = None) -> None:
    """Join the group's torch.distributed process group (and tell transformers who we are): rank 0
    through the rendezvous `store` it serves, a follower as that store's client."""
    os.environ.update(RANK=str(info.rank), LOCAL_RANK=str(info.rank), WORLD_SIZE=str(info.world_size))
    backend = "nccl" if torch.device(device).type == "cuda" else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(torch.device(device))
    if store is None:
        store = dist.TCPStore("127.0.0.1", info.store_port, info.world_size, is_master=False, timeout=COLLECTIVE_TIMEOUT)
    dist.init_process_group(backend, store=store, rank=info.rank, world_size=info.world_size, timeout=COLLECTIVE_TIMEOUT)


def _rendezvous_store(world_size: int) -> dist.TCPStore:
    """Rank 0's rendezvous server, on a port the OS picks as it binds (a port found free and bound
    later can be taken in between by any connection's ephemeral port: EADDRINUSE, seen in CI)."""
    return dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, timeout=COLLECTIVE_TIMEOUT, wait_for_workers=False)


@dataclass(eq=False)
class _Ask:
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[dict[int, Any]]
    waiting: set[int]
    values: dict[int, Any]


class TensorParallelGroup:
    """Rank 0 of a running group. `start` returns once every follower has joined."""

    def __init__(self, info: RankInfo, processes: list[RankHandle], channels: list[Connection]):
        self.info = info
        self._processes = processes
        self._channels = channels
        self._send_lock = threading.Lock()
        self._asks: dict[Hashable, _Ask] = {}
        self._asks_lock = threading.Lock()
        self._lost: set[int] = set()
        self._closing = False
        self.on_lost: Callable[[RankLost], None] | None = None
        """Called (from a reader thread) the moment a follower's channel closes while the group runs:
        the engine can never step again, so its owner should give the worker up."""
        for rank, channel in enumerate(channels, start=1):
            threading.Thread(target=self._read, args=(rank, channel), name=f"pdserve-tp-replies{rank}", daemon=True).start()

    @classmethod
    def start(cls, config: EngineConfig, agent: tuple[str, Any] | None = None, launcher: RankLauncher | None = None) -> TensorParallelGroup:
        check_tensor_parallel(config.model, config.tensor_parallel_size)
        world = config.tensor_parallel_size
        authkey = secrets.token_bytes(16)
        listener = Listener(("127.0.0.1", 0), authkey=authkey)
        store = _rendezvous_store(world)
        info = RankInfo(0, world, store.port, listener.address, authkey, agent)
        launcher = launcher or LocalRanks()
        processes = [launcher.launch(config, dataclasses.replace(info, rank=rank)) for rank in range(1, world)]
        try:
            channels = [listener.accept() for _ in processes]
            channels.sort(key=lambda c: c.recv())  # each follower says its rank first
            join(info, info.device(config.device), store)
        except BaseException:
            for process in processes:
                process.kill()
            raise
        finally:
            listener.close()
        log.info("tensor-parallel group of %d ranks ready", world)
        return cls(info, processes, channels)

    # ---- steps -------------------------------------------------------------------------------------
    def run_step(self, runner: ModelRunner, items: list[StepItem], sink_requests: list[SinkRequest],
                 hook: Callable[[int], None] | None) -> tuple[list[int], torch.Tensor]:
        """Send the step to every follower, then run rank 0's share of it."""
        try:
            self._send_all(Step(items, sink_requests))
            return runner.execute(items, hook)
        except Exception as exc:  # a closed channel, a collective whose peer is gone, a failed forward
            lost = self.lost_ranks()
            if lost:
                raise RankLost(f"rank(s) {lost} of the tensor-parallel group exited") from exc
            # the followers ran (or are running) a step rank 0 did not finish: the ranks' collectives
            # are out of step for good, so the group is as lost as if a rank had died
            raise RankLost(f"rank 0's step failed ({type(exc).__name__}: {exc}); the ranks are out of step") from exc

    # ---- the followers' rank agents ----------------------------------------------------------------
    def tell(self, key: Hashable, payloads: dict[int, Any]) -> None:
        """Give follower ranks a call they answer with no reply (rank -> payload)."""
        for rank, payload in payloads.items():
            self._send(rank, Call(key, payload))

    async def ask(self, key: Hashable, payloads: dict[int, Any]) -> dict[int, Any]:
        """Give follower ranks a call each and wait for every one's reply (rank -> value)."""
        loop = asyncio.get_running_loop()
        ask = _Ask(loop, loop.create_future(), set(payloads), {})
        with self._asks_lock:
            if key in self._asks:
                raise ValueError(f"{key!r} is already being asked")
            self._asks[key] = ask
        try:
            if self._lost:
                raise RankLost(f"rank(s) {sorted(self._lost)} of the tensor-parallel group exited")
            self.tell(key, payloads)
            return await ask.future
        finally:
            with self._asks_lock:
                self._asks.pop(key, None)

    def _read(self, rank: int, channel: Connection) -> None:
        while True:
            try:
                reply: Reply = channel.recv()
            except (EOFError, OSError):
                self._on_lost(rank)
                return
            with self._asks_lock:
                ask = self._asks.get(reply.key)
                if ask is None or reply.rank not in ask.waiting:
                    continue
                ask.waiting.discard(reply.rank)
                ask.values[reply.rank] = reply.value
                done = not ask.waiting
            if done:
                ask.loop.call_soon_threadsafe(_resolve, ask.future, ask.values)

    def _on_lost(self, rank: int) -> None:
        if self._closing:
            return
        self._lost.add(rank)
        error = RankLost(f"rank {rank} of the tensor-parallel group exited")
        log.error("%s", error)
        with self._asks_lock:
            pending = list(self._asks.values())
        for ask in pending:
            ask.loop.call_soon_threadsafe(_resolve, ask.future, error)
        if self.on_lost is not None:
            self.on_lost(error)

    def _send(self, rank: int, message: Any) -> None:
        with self._send_lock:
            self._channels[rank - 1].send(message)

    def _send_all(self, message: Any) -> None:
        with self._send_lock:
            for channel in self._channels:
                channel.send(message)

    # ---- lifecycle -----------------------------------------------------------------------------------
    @property
    def followers(self) -> range:
        return range(1, self.info.world_size)

    def lost_ranks(self) -> list[int]:
        return sorted(self._lost | {rank for rank, p in enumerate(self._processes, start=1) if not p.is_alive()})

    def close(self, timeout: float = 30.0) -> None:
        self._closing = True
        try:
            self._send_all(STOP)
        except OSError:
            pass  # a follower already gone
        for process in self._processes:
            process.join(timeout)
            if process.is_alive():
                process.kill()
        for channel in self._channels:
            channel.close()
        if dist.is_initialized():
            dist.destroy_process_group()


def _resolve(future: asyncio.Future, outcome: Any) -> None:
    if future.done():
        return
    if isinstance(outcome, BaseException):
        future.set_exception(outcome)
    else:
        future.set_result(outcome)

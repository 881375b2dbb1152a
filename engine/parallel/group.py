"""Rank 0's side of a tensor-parallel group: start the followers, broadcast steps, stop them.

The step channel is a local socket (`multiprocessing.connection`, authenticated with a per-group
key): a TP group always sits on one node (one placement group bundle per rank, STRICT_PACK), and a
plain pipe has no timeout to trip over while the engine idles. The tensors move over the
torch.distributed group that `join` sets up.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import multiprocessing
import os
import secrets
import socket
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection, Listener

import torch
import torch.distributed as dist

from common.engine_config import EngineConfig
from engine.errors import RankLost
from engine.model_loader import check_tensor_parallel
from engine.model_runner import ModelRunner
from engine.step import StepItem

log = logging.getLogger(__name__)

COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=5)
"""How long one collective may wait for a peer before it fails (a rank that hangs, not one that dies:
a dead peer's closed connection fails the collective at once)."""


@dataclass(frozen=True)
class RankInfo:
    rank: int
    world_size: int
    init_method: str
    """torch.distributed rendezvous, tcp://127.0.0.1:PORT (the ranks share a node)."""
    steps_address: tuple[str, int]
    authkey: bytes

    def device(self, configured: str) -> str:
        """One GPU per rank: rank r uses cuda:r of its node; CPU ranks share the CPU."""
        return f"cuda:{self.rank}" if torch.device(configured).type == "cuda" else configured


def join(info: RankInfo, device: str) -> None:
    """Join the group's torch.distributed process group (and tell transformers who we are)."""
    os.environ.update(RANK=str(info.rank), LOCAL_RANK=str(info.rank), WORLD_SIZE=str(info.world_size))
    backend = "nccl" if torch.device(device).type == "cuda" else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(torch.device(device))
    dist.init_process_group(backend, init_method=info.init_method, rank=info.rank, world_size=info.world_size,
                            timeout=COLLECTIVE_TIMEOUT)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class TensorParallelGroup:
    """Rank 0 of a running group. `start` returns once every follower has joined."""

    def __init__(self, info: RankInfo, processes: list[multiprocessing.process.BaseProcess], channels: list[Connection]):
        self.info = info
        self._processes = processes
        self._channels = channels

    @classmethod
    def start(cls, config: EngineConfig) -> TensorParallelGroup:
        from engine.parallel.follower import serve_rank

        check_tensor_parallel(config.model, config.tensor_parallel_size)
        world = config.tensor_parallel_size
        authkey = secrets.token_bytes(16)
        listener = Listener(("127.0.0.1", 0), authkey=authkey)
        info = RankInfo(0, world, f"tcp://127.0.0.1:{_free_port()}", listener.address, authkey)
        spawn = multiprocessing.get_context("spawn")
        processes = []
        for rank in range(1, world):
            process = spawn.Process(target=serve_rank, args=(config, dataclasses.replace(info, rank=rank)),
                                    name=f"pdserve-tp-rank{rank}", daemon=True)
            process.start()
            processes.append(process)
        try:
            channels = [listener.accept() for _ in processes]
            channels.sort(key=lambda c: c.recv())  # each follower says its rank first
            join(info, info.device(config.device))
        except BaseException:
            for process in processes:
                process.kill()
            raise
        finally:
            listener.close()
        log.info("tensor-parallel group of %d ranks ready", world)
        return cls(info, processes, channels)

    def broadcast(self, items: list[StepItem] | None) -> None:
        """Send the step every rank runs next (None: stop)."""
        for channel in self._channels:
            channel.send(items)

    def runner(self, local: ModelRunner) -> BroadcastingRunner:
        """Rank 0's model runner: each step goes to every rank, then runs here."""
        return BroadcastingRunner(local, self)

    def lost_ranks(self) -> list[int]:
        return [rank for rank, p in enumerate(self._processes, start=1) if not p.is_alive()]

    def close(self, timeout: float = 30.0) -> None:
        try:
            self.broadcast(None)
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


class BroadcastingRunner:
    """The model runner as rank 0 of a group sees it: same `execute`, every rank runs the step."""

    def __init__(self, local: ModelRunner, group: TensorParallelGroup):
        self.local, self.group = local, group

    def execute(self, batch: list[StepItem], on_layer_written: Callable[[int], None] | None = None) -> tuple[list[int], torch.Tensor]:
        try:
            self.group.broadcast(batch)
            return self.local.execute(batch, on_layer_written)
        except (OSError, RuntimeError) as exc:  # a closed channel, a collective whose peer is gone
            lost = self.group.lost_ranks()
            if not lost:
                raise
            raise RankLost(f"rank(s) {lost} of the tensor-parallel group exited") from exc

    def __getattr__(self, name: str):
        return getattr(self.local, name)

"""Ranks 1..N-1 of a tensor-parallel group: run every step rank 0 sends, until it says stop.

A follower has no scheduler and no sampler: it loads its shard of the model, builds its own KV pool
(its KV heads, the same block count as rank 0, so rank 0's block tables address it), and runs the
forward of each `Step` it receives. A worker may give it a rank agent (`RankInfo.agent`): the
follower's own KV endpoint (a sender or a receiver of its heads), which gets the `Call`s rank 0
sends it and is the sink of its layers. The follower exits when rank 0 sends STOP or its channel
closes (rank 0 gone).
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
import threading
from collections.abc import Callable
from multiprocessing.connection import Client
from typing import Any, Protocol

import torch
import torch.distributed as dist

from common.engine_config import EngineConfig
from engine.kv_sink import KVLayerSink, layer_hook
from engine.parallel.group import RankInfo, join
from engine.parallel.messages import STOP, Call, Reply, Step
from engine.runtime import Runtime

log = logging.getLogger(__name__)

Respond = Callable[[Any], None]


class RankAgent(Protocol):
    sink: KVLayerSink | None

    def handle(self, call: Call, respond: Respond) -> None:
        """Act on a call at once (never block the step loop); `respond(value)` answers it, from any thread."""
        ...

    def close(self) -> None: ...


def serve_rank(config: EngineConfig, info: RankInfo) -> None:
    from engine.runtime import build_runtime

    channel = Client(info.steps_address, authkey=info.authkey)
    channel.send(info.rank)
    device = info.device(config.device)
    if config.num_threads:
        torch.set_num_threads(config.num_threads)
    join(info, device)
    runtime = build_runtime(dataclasses.replace(config, device=device))
    agent = _agent(info, runtime, config)
    sending = threading.Lock()

    def reply(key, value) -> None:
        with sending:
            channel.send(Reply(key, info.rank, value))

    try:
        _run(channel, runtime, agent, reply)
    finally:
        if agent is not None:
            agent.close()
        channel.close()
        dist.destroy_process_group()


def _run(channel, runtime: Runtime, agent: RankAgent | None, reply: Callable[[Any, Any], None]) -> None:
    sink = agent.sink if agent is not None else None
    while True:
        try:
            message = channel.recv()
        except EOFError:
            log.warning("rank 0 is gone; exiting")
            return
        if message is STOP:
            return
        if isinstance(message, Step):
            runtime.runner.execute(message.items, layer_hook(runtime.kv_cache, sink, message.sink_requests))
        elif isinstance(message, Call) and agent is not None:
            agent.handle(message, lambda value, key=message.key: reply(key, value))


def _agent(info: RankInfo, runtime: Runtime, config: EngineConfig) -> RankAgent | None:
    if not info.agent:
        return None
    spec, settings = info.agent
    module, _, name = spec.partition(":")
    return getattr(importlib.import_module(module), name)(runtime, info.rank, config, settings)

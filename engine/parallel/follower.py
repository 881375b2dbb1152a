"""Ranks 1..N-1 of a tensor-parallel group: run every step rank 0 sends, until it says stop.

A follower has no scheduler and no sampler: it loads its shard of the model, builds its own KV pool
(its KV heads, the same block count as rank 0, so rank 0's block tables address it), and runs the
forward of each step it receives. It exits when rank 0 sends None or its channel closes (rank 0 gone).
"""

from __future__ import annotations

import dataclasses
import logging
from multiprocessing.connection import Client

import torch.distributed as dist

from common.engine_config import EngineConfig
from engine.parallel.group import RankInfo, join

log = logging.getLogger(__name__)


def serve_rank(config: EngineConfig, info: RankInfo) -> None:
    from engine.runtime import build_runtime

    channel = Client(info.steps_address, authkey=info.authkey)
    channel.send(info.rank)
    device = info.device(config.device)
    join(info, device)
    runtime = build_runtime(dataclasses.replace(config, device=device))
    try:
        while True:
            try:
                items = channel.recv()
            except EOFError:
                log.warning("rank %d: rank 0 is gone; exiting", info.rank)
                return
            if items is None:
                return
            runtime.runner.execute(items)
    finally:
        channel.close()
        dist.destroy_process_group()

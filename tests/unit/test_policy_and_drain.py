"""Routing policies take the engine's block size from the config; `wait_idle` (the one drain wait
of router, workers and their actors) waits for requests in flight, settles, and gives up on time."""

from __future__ import annotations

import asyncio
import time

from common.block_hash import chain_hashes
from common.config import config_from_dict
from common.serving import wait_idle
from router.policy import make_policy
from router.pool import Worker, WorkerPool


def worker(worker_id: str) -> Worker:
    return Worker(worker_id, "prefill", f"{worker_id}:1", channel=None, stub=None)


def test_prefix_aware_hashes_whole_blocks_of_the_configured_size():
    prompt = list(range(40))
    assert len(chain_hashes(prompt, 16)) == 2 and len(chain_hashes(prompt, 32)) == 1
    policy = make_policy("prefix_aware", 32)
    a, b = worker("a"), worker("b")
    assert policy.choose("prefill", [a, b], prompt) is a
    assert len(policy._seen["a"]) == 1  # one 32-token block remembered, not two 16-token ones
    b.in_flight = a.in_flight = 1
    assert policy.choose("prefill", [b, a], prompt) is a  # the cached prefix wins at equal load


async def test_router_pool_uses_engine_block_size():
    config = config_from_dict({"engine": {"block_size": 64}, "router": {"policy": "prefix_aware"}})
    pool = WorkerPool(config.router.policy, block_size=config.engine.block_size)
    assert pool.policy.block_size == 64
    assert WorkerPool().policy.block_size == 16  # the engine's default


async def test_wait_idle_waits_until_nothing_is_in_flight():
    in_flight = [2]

    async def finish_later():
        for _ in range(2):
            await asyncio.sleep(0.05)
            in_flight[0] -= 1

    task = asyncio.create_task(finish_later())
    assert await wait_idle(lambda: in_flight[0], poll_s=0.01) == 0
    assert task.done()


async def test_wait_idle_settles_and_times_out():
    samples, last_busy = [], [0.0]

    def count() -> int:
        samples.append(len(samples))
        if len(samples) <= 3:  # busy for the first three samples
            last_busy[0] = time.monotonic()
            return 1
        return 0

    assert await wait_idle(count, settle_s=0.05, poll_s=0.01) == 0
    assert time.monotonic() - last_busy[0] >= 0.05  # it stayed idle for settle_s before returning
    assert await wait_idle(lambda: 3, timeout_s=0.05, poll_s=0.01) == 3  # still busy at the deadline

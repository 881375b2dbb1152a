"""The router's local-prefill threshold: from the config at start, moved at run time by the adaptive controller,
counted in what the decode worker would compute (under kv_aware: the prompt's tokens it does not hold)."""

from __future__ import annotations

import asyncio

from common.block_hash import chain_hashes
from common.config import RouterConfig
from router.metrics import RouterMetrics
from router.orchestration import Orchestrator
from router.pool import WorkerPool
from router.settings import RouterSettings

BLOCK = 16


async def cluster(policy: str, threshold: int) -> tuple[Orchestrator, WorkerPool]:
    pool = WorkerPool(policy=policy, block_size=BLOCK)
    pool.add("prefill-0", "prefill", "127.0.0.1:1", static=True)
    pool.add("decode-0", "decode", "127.0.0.1:2", static=True)
    settings = RouterSettings("m", 2048, "tcp", config=RouterConfig(policy=policy, local_prefill_threshold=threshold))
    return Orchestrator(settings, None, pool, RouterMetrics()), pool


def test_threshold_starts_at_the_config_and_moves_at_run_time():
    async def scenario() -> list[bool]:
        orchestrator, pool = await cluster("round_robin", 16)
        decoder = pool.candidates("decode", set())[0]
        seen = [orchestrator._prefill_locally([1] * 16, decoder), orchestrator._prefill_locally([1] * 17, decoder)]
        orchestrator.local_prefill_threshold = 64
        seen.append(orchestrator._prefill_locally([1] * 17, decoder))
        orchestrator.local_prefill_threshold = 0
        seen.append(orchestrator._prefill_locally([1] * 1, decoder))
        await pool.close()
        return seen

    assert asyncio.run(scenario()) == [True, False, True, False]


def test_under_kv_aware_the_threshold_counts_only_what_the_decode_worker_does_not_hold():
    prompt = list(range(100, 150))  # 50 tokens: 3 full blocks the decode worker may hold, 2 tokens past them

    async def scenario() -> list[bool]:
        seen = []
        for policy in ("kv_aware", "round_robin"):
            orchestrator, pool = await cluster(policy, 16)
            decoder = pool.candidates("decode", set())[0]
            seen.append(orchestrator._prefill_locally(prompt, decoder))  # nothing held: 50 tokens to compute
            index = pool.kv_index
            index.apply("decode-0", index.open("decode-0"), 1, True, [(True, "pool", chain_hashes(prompt, BLOCK)[:2])])
            seen.append(orchestrator._prefill_locally(prompt, decoder))  # 32 held: 18 left, over 16
            index.apply("decode-0", index.epoch("decode-0"), 2, False, [(True, "host", chain_hashes(prompt, BLOCK)[2:3])])
            seen.append(orchestrator._prefill_locally(prompt, decoder))  # the third block in its tier: 2 left
            await pool.close()
        return seen

    assert asyncio.run(scenario()) == [False, False, True,  # kv_aware: the conversation's new turn runs on D
                                       False, False, False]  # round_robin counts the whole prompt

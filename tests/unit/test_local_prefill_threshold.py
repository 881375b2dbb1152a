"""The router's local-prefill threshold: from the config at start, moved at run time by the adaptive controller."""

from __future__ import annotations

import asyncio

from common.config import RouterConfig
from router.metrics import RouterMetrics
from router.orchestration import Orchestrator
from router.pool import WorkerPool
from router.settings import RouterSettings


def test_threshold_starts_at_the_config_and_moves_at_run_time():
    async def scenario() -> list[bool]:
        pool = WorkerPool()
        pool.add("prefill-0", "prefill", "127.0.0.1:1", static=True)
        pool.add("decode-0", "decode", "127.0.0.1:2", static=True)
        settings = RouterSettings("m", 2048, "tcp", config=RouterConfig(local_prefill_threshold=16))
        orchestrator = Orchestrator(settings, None, pool, RouterMetrics())
        seen = [orchestrator._prefill_locally([1] * 16), orchestrator._prefill_locally([1] * 17)]
        orchestrator.local_prefill_threshold = 64
        seen.append(orchestrator._prefill_locally([1] * 17))
        orchestrator.local_prefill_threshold = 0
        seen.append(orchestrator._prefill_locally([1] * 1))
        await pool.close()
        return seen

    assert asyncio.run(scenario()) == [True, False, True, False]

"""`run_load`: one run of a workload against a backend, open loop (arrival times) with an optional cap on
main requests in flight, and an optional early stop of the main requests after the bursts."""

from __future__ import annotations

import asyncio
import logging
import sys
import time

from bench.servebench.records import CANCELLED, RequestRecord
from bench.servebench.workload import RequestSpec

log = logging.getLogger("bench.serve")


async def run_load(backend, specs: list[RequestSpec], max_concurrency: int | None, progress: bool = True,
                   stop_after_bursts: float | None = None) -> tuple[list[RequestRecord], float]:
    """Send `specs` at their arrival times (main requests capped at `max_concurrency` in flight);
    returns the records of the requests sent and the duration (first send to last finish).

    `stop_after_bursts`: that many seconds after the last burst request finished, main requests
    still streaming are cancelled (finish_reason "cancelled") and those not sent yet are dropped."""
    from tqdm import tqdm

    bar = tqdm(total=len(specs), file=sys.stderr, disable=not progress, desc="requests", leave=False)
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    t0 = time.perf_counter()

    def clock() -> float:
        return time.perf_counter() - t0

    async def one(spec: RequestSpec) -> RequestRecord:
        rec = RequestRecord(spec.index, spec.group, spec.burst, spec.arrival_s, spec.prompt_len, spec.output_len, priority=spec.priority)
        try:
            delay = spec.arrival_s - clock()
            if delay > 0:
                await asyncio.sleep(delay)
            if limit is not None and spec.group == "main":
                async with limit:
                    await backend.send(spec, rec, clock)
            else:
                await backend.send(spec, rec, clock)
        except asyncio.CancelledError:  # only run_load cancels (stop_after_bursts)
            rec.ok, rec.error, rec.finish_reason, rec.end_s = False, "cancelled by the benchmark", CANCELLED, clock()
        except Exception as exc:  # a client-side failure is one failed request, not a failed run
            log.exception("request %d failed in the client", spec.index)
            rec.ok, rec.error, rec.end_s = False, f"client: {type(exc).__name__}: {exc}", clock()
        bar.update(1)
        return rec

    tasks = [asyncio.ensure_future(one(s)) for s in specs]
    bursts = [t for t, s in zip(tasks, specs) if s.group == "burst"]
    if stop_after_bursts is not None and bursts:
        await asyncio.wait(bursts)
        await asyncio.sleep(stop_after_bursts)
        for task, spec in zip(tasks, specs):
            if spec.group == "main" and not task.done():
                task.cancel()
    records = [r for r in await asyncio.gather(*tasks) if r.sent]
    bar.close()
    started = min((r.start_s for r in records), default=0.0)
    finished = max((r.end_s for r in records), default=0.0)
    return sorted(records, key=lambda r: r.index), finished - started

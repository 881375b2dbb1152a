"""What a simulated run reports: per-request latencies, ITL over all gaps, goodput, reuse and KV moved.

Percentiles are numpy's (linear interpolation), as bench/servebench/metrics.py reports them; ITL gaps
come from aggregated decode runs as (value, count) pairs, so their percentiles are weighted (the gap
value at the rank). Goodput is common/slo.py's definition: requests meeting every SLO per second of the
run (first arrival to last finish).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from common.slo import goodput, meets_slos
from sim.workload import SimRequest


class Metrics:
    def __init__(self) -> None:
        self._itl_values: list[float] = []
        self._itl_counts: list[int] = []

    def add_itl(self, value: float, count: int) -> None:
        self._itl_values.append(value)
        self._itl_counts.append(count)

    def itl_ms(self) -> dict[str, float | None]:
        if not self._itl_values:
            return {"p50": None, "p99": None, "mean": None}
        values, counts = np.asarray(self._itl_values) * 1000, np.asarray(self._itl_counts, dtype=float)
        order = np.argsort(values, kind="stable")
        values, counts = values[order], counts[order]
        cum = np.cumsum(counts)

        def at(p: float) -> float:
            return float(values[min(np.searchsorted(cum, p / 100 * cum[-1]), len(values) - 1)])

        return {"p50": at(50), "p99": at(99), "mean": float((values * counts).sum() / cum[-1])}


def percentiles_ms(values_s: list[float]) -> dict[str, float | None]:
    if not values_s:
        return {"p50": None, "p99": None, "mean": None}
    ms = np.asarray(values_s) * 1000
    return {"p50": float(np.percentile(ms, 50)), "p99": float(np.percentile(ms, 99)), "mean": float(ms.mean())}


def stats_of(r: SimRequest) -> dict[str, float | None]:
    """The request in bench/servebench's token_stats terms (seconds)."""
    return {"ttft": r.ttft, "tpot": r.tpot, "e2e": r.e2e}


def summarize(requests: list[SimRequest], metrics: Metrics, slos_ms: dict[str, float] | None) -> dict[str, Any]:
    done = [r for r in requests if r.finish is not None]
    start = min((r.arrival for r in requests), default=0.0)
    duration = max((r.finish for r in done), default=start) - start
    good = sum(1 for r in done if (r.slos_ms or slos_ms) and meets_slos(stats_of(r), r.slos_ms or slos_ms))
    prompt = sum(r.prompt_len for r in done)
    computed = sum(r.prompt_computed for r in requests)
    return {
        "requests": len(requests), "completed": len(done), "rejected": sum(r.rejected for r in requests),
        "duration_s": duration,
        "request_throughput": len(done) / duration if duration > 0 else 0.0,
        "output_throughput": sum(r.output_len for r in done) / duration if duration > 0 else 0.0,
        "ttft_ms": percentiles_ms([r.ttft for r in done]),
        "tpot_ms": percentiles_ms([r.tpot for r in done if r.tpot is not None]),
        "itl_ms": metrics.itl_ms(),
        "e2e_ms": percentiles_ms([r.e2e for r in done]),
        "ttft_attainment": (sum(1 for r in done if r.ttft * 1000 <= slos_ms["ttft"]) / len(requests)
                            if slos_ms and "ttft" in slos_ms and requests else None),
        "good_requests": good, "goodput": goodput(good, duration), "slos_ms": slos_ms,
        "prompt_tokens": prompt, "prompt_tokens_computed": computed, "reuse": 1 - computed / prompt if prompt else 0.0,
        "kv_bytes_moved": sum(r.kv_bytes for r in requests),
        "kv_bytes_per_request": sum(r.kv_bytes for r in requests) / len(requests) if requests else 0.0,
        "preemptions": sum(r.preemptions for r in requests),
    }


def per_request(requests: list[SimRequest]) -> list[dict[str, Any]]:
    return [{"index": r.index, "arrival_s": r.arrival, "prompt_len": r.prompt_len, "output_len": r.output_len,
             "ttft_s": r.ttft, "tpot_s": r.tpot, "e2e_s": r.e2e, "prompt_computed": r.prompt_computed, "kv_bytes": r.kv_bytes,
             "preemptions": r.preemptions, "rejected": r.rejected, "prefill_worker": r.prefill_worker,
             "decode_worker": r.decode_worker} for r in requests]

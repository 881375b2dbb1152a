"""Service-level objectives: whether one request met its SLOs, and goodput (torch-free).

The one definition the serving benchmarks (bench/servebench/metrics.py) and the cluster simulator
(sim/metrics.py) both score by: a request is good when every SLO it is given (TTFT, TPOT, E2E
latency, in ms) holds; goodput is good requests per second of the run.
"""

from __future__ import annotations


def meets_slos(stats: dict, slos_ms: dict[str, float]) -> bool:
    """Whether a record's token_stats (seconds: ttft, tpot or None, e2e) meet every SLO (ms) of `slos_ms` it measures."""
    measured = {"ttft": stats["ttft"], "tpot": stats["tpot"] or 0.0, "e2el": stats["e2e"]}
    return all(measured[k] * 1000.0 <= v for k, v in slos_ms.items() if k in measured)


def goodput(good_requests: int, duration_s: float) -> float:
    """Good requests per second of a run (first request sent to last finished); 0 for an empty run."""
    return good_requests / duration_s if duration_s > 0 else 0.0

"""What the client observed of one request (`RequestRecord`: times since the run's start, one stamp per
streamed chunk) and the per-request statistics every metric is computed from (`token_stats`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class RequestRecord:
    """One request as observed by the client. Times are seconds since the run's start."""

    index: int
    group: str
    burst: int | None
    scheduled_s: float
    prompt_len: int
    max_tokens: int
    start_s: float = 0.0
    end_s: float = 0.0
    chunk_times_s: list[float] = field(default_factory=list)
    chunk_tokens: list[int] = field(default_factory=list)
    prompt_tokens: int | None = None
    cached_prompt_tokens: int | None = None  # the server's usage: prompt tokens served from a cache
    output_tokens: int = 0
    ok: bool = False
    error: str | None = None
    finish_reason: str | None = None
    server_timings: dict[str, float] | None = None
    sent: bool = False
    priority: int = 0


CANCELLED = "cancelled"
"""finish_reason of a main request the benchmark itself cancelled (--stop-after-bursts): its chunks
count for ITL, but it is neither completed nor failed."""


def streamed(rec: dict) -> bool:
    """Completed, or cancelled by the benchmark: its chunk timestamps are real ITL samples."""
    return bool(rec["ok"] or rec.get("finish_reason") == CANCELLED)


def token_stats(rec: dict) -> dict[str, Any] | None:
    """TTFT, E2E, TPOT (s; None for a one-token answer) and ITL gaps of one successful record."""
    if not rec["ok"] or not rec["chunk_times_s"]:
        return None
    times = rec["chunk_times_s"]
    ttft = times[0] - rec["start_s"]
    e2e = rec["end_s"] - rec["start_s"]
    n_out = rec["output_tokens"]
    tpot = (e2e - ttft) / (n_out - 1) if n_out > 1 else None
    itl = [b - a for a, b in zip(times, times[1:])]
    return {"ttft": ttft, "e2e": e2e, "tpot": tpot, "itl": itl}

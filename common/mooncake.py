"""The Mooncake trace format (torch-free): parse a JSONL trace, pick a window of whole conversations,
scale its lengths to a machine's tokens and its arrivals to a rate.

Shared by the trace replayer (bench/trace/workload.py, which adds token ids and reuse bounds) and the
cluster simulator (sim/), which cannot import bench/. Lifecycle: `load_trace` -> `select_window` ->
`Scale` (lengths) and `compress_time` (arrival offsets).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

TRACE_BLOCK = 512
"""Tokens per hash id in the Mooncake trace files."""


@dataclass(frozen=True)
class TraceRequest:
    timestamp_ms: int
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def load_trace(path: str | Path) -> list[TraceRequest]:
    """Every line of a Mooncake-format JSONL trace; a bad line raises ValueError naming its line and field."""
    requests = []
    with open(path) as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            requests.append(_parse(json.loads(line), f"{path}:{number}"))
    if not requests:
        raise ValueError(f"{path}: no requests")
    return requests


def _parse(row: dict, where: str) -> TraceRequest:
    for name in ("timestamp", "input_length", "output_length"):
        if not isinstance(row.get(name), int | float) or row[name] < 0:
            raise ValueError(f"{where}: {name} must be a number >= 0, got {row.get(name)!r}")
    ids = row.get("hash_ids")
    if not isinstance(ids, list) or not ids or not all(isinstance(i, int) and i >= 0 for i in ids):
        raise ValueError(f"{where}: hash_ids must be a non-empty list of integers >= 0")
    if row["input_length"] < 1:
        raise ValueError(f"{where}: input_length must be >= 1, got {row['input_length']!r}")
    return TraceRequest(int(row["timestamp"]), int(row["input_length"]), int(row["output_length"]), tuple(ids))


def conversation_key(request: TraceRequest, index: int) -> tuple:
    """The conversation a request belongs to: its first two hash ids; a one-block prompt is its own."""
    return request.hash_ids[:2] if len(request.hash_ids) > 1 else ("single", index)


def select_window(trace: list[TraceRequest], start_s: float = 0.0, end_s: float | None = None, requests: int | None = None,
                  seed: int = 0) -> list[TraceRequest]:
    """Requests arriving in [start_s, end_s) of trace time; with `requests`, whole conversations in a seeded
    order until at least that many are taken (the last conversation is kept whole). Arrival order kept."""
    indexed = [(i, r) for i, r in enumerate(trace)
               if r.timestamp_ms >= start_s * 1000 and (end_s is None or r.timestamp_ms < end_s * 1000)]
    if requests is None or requests >= len(indexed):
        return [r for _, r in indexed]
    groups: dict[tuple, list[int]] = {}
    for i, r in indexed:
        groups.setdefault(conversation_key(r, i), []).append(i)
    order = sorted(groups, key=lambda key: hashlib.sha256(repr((seed, key)).encode()).digest())
    chosen: list[int] = []
    for key in order:
        if len(chosen) >= requests:
            break
        chosen.extend(groups[key])
    return [trace[i] for i in sorted(chosen)]


@dataclass(frozen=True)
class Scale:
    """Trace lengths in this machine's tokens: `tokens_per_block` per trace block (lengths x tokens_per_block /
    512); answers x `output_scale` (default the same factor), clamped to [min_output, max_output]."""

    tokens_per_block: int = 16
    output_scale: float | None = None
    min_output: int = 2
    max_output: int = 64

    @property
    def factor(self) -> float:
        return self.tokens_per_block / TRACE_BLOCK

    def prompt_len(self, request: TraceRequest) -> int:
        """input_length x factor, kept inside the request's last block (so every hash id has >= 1 token)."""
        n, b = len(request.hash_ids), self.tokens_per_block
        return min(n * b, max((n - 1) * b + 1, round(request.input_length * self.factor)))

    def output_len(self, request: TraceRequest) -> int:
        scale = self.factor if self.output_scale is None else self.output_scale
        return min(self.max_output, max(self.min_output, round(request.output_length * scale)))

    def full_blocks(self, request: TraceRequest) -> int:
        return self.prompt_len(request) // self.tokens_per_block


def compress_time(requests: list[TraceRequest], rate: float) -> tuple[list[float], float]:
    """Arrival offsets (s, the first at 0) keeping the window's gaps, all divided by one speed-up so that the
    mean rate ((n - 1) / span) is `rate` req/s; returns (offsets, speed-up). A window with no span: all at 0."""
    if not requests:
        return [], 1.0
    t0 = requests[0].timestamp_ms
    span_s = (requests[-1].timestamp_ms - t0) / 1000
    if span_s <= 0 or len(requests) < 2:
        return [0.0] * len(requests), float("inf")
    speedup = rate * span_s / (len(requests) - 1)
    return [(r.timestamp_ms - t0) / 1000 / speedup for r in requests], speedup

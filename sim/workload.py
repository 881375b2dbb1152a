"""Simulated requests: from a Mooncake trace (common/mooncake.py: the replayer's window, scaling and
time compression) or from a synthetic distribution (Poisson arrivals, uniform lengths).

A `SimRequest` carries what the simulator needs (arrival, prompt and answer lengths, the chained keys of
its prompt's full blocks: equal leading hash ids give equal keys, so prefix caches and the KV index
see the same reuse the trace has) and the results the run fills in. Keys are ints (Python hashes of
(previous key, hash id): deterministic for ints), one per block of `block_tokens` tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from common.mooncake import Scale, TraceRequest, compress_time


@dataclass(slots=True)
class SimRequest:
    index: int
    arrival: float
    prompt_len: int
    output_len: int
    keys: tuple[int, ...]
    """Chained keys of the prompt's full blocks."""
    slos_ms: dict[str, float] | None = None
    group: str = ""
    # ---- filled by the run ------------------------------------------------------------------------
    first_token: float | None = None
    finish: float | None = None
    generated: int = 0
    prompt_computed: int = 0
    kv_bytes: float = 0.0
    preemptions: int = 0
    rejected: bool = False
    prefill_worker: int = -1
    decode_worker: int = -1
    stage_s: dict[str, float] = field(default_factory=dict)

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.arrival

    @property
    def e2e(self) -> float | None:
        return None if self.finish is None else self.finish - self.arrival

    @property
    def tpot(self) -> float | None:
        if self.finish is None or self.output_len < 2:
            return None
        return (self.finish - self.first_token) / (self.output_len - 1)


def chain_keys(hash_ids, full_blocks: int) -> tuple[int, ...]:
    keys, parent = [], 0
    for h in hash_ids[:full_blocks]:
        parent = hash((parent, h))
        keys.append(parent)
    return tuple(keys)


def from_trace(trace: list[TraceRequest], scale: Scale, rate: float | None = None, slos_ms: dict[str, float] | None = None,
               offsets: list[float] | None = None) -> list[SimRequest]:
    """The trace's requests with scaled lengths; arrivals at the trace's own times, or compressed to `rate`
    req/s (compress_time), or at given `offsets` (s). One block = `scale.tokens_per_block` tokens."""
    if offsets is None:
        if rate is None:
            t0 = trace[0].timestamp_ms if trace else 0
            offsets = [(r.timestamp_ms - t0) / 1000 for r in trace]
        else:
            offsets, _ = compress_time(trace, rate)
    out = []
    for i, (r, t) in enumerate(zip(trace, offsets)):
        n = scale.prompt_len(r)
        out.append(SimRequest(i, t, n, scale.output_len(r), chain_keys(r.hash_ids, n // scale.tokens_per_block), slos_ms))
    return out


def synthetic(n: int, rate: float, prompt_len: tuple[int, int], output_len: tuple[int, int], block_tokens: int, seed: int = 0,
              slos_ms: dict[str, float] | None = None, start: float = 0.0, first_index: int = 0,
              group: str = "") -> list[SimRequest]:
    """`n` requests, Poisson arrivals at `rate` req/s (rate <= 0: all at `start`), lengths uniform in the
    inclusive ranges; every prompt distinct (no prefix shared)."""
    rng = np.random.default_rng(seed)
    gaps = rng.exponential(1 / rate, n) if rate > 0 else np.zeros(n)
    times = start + np.cumsum(gaps) - (gaps[0] if n else 0)
    prompts = rng.integers(prompt_len[0], prompt_len[1] + 1, n)
    outputs = rng.integers(output_len[0], output_len[1] + 1, n)
    out = []
    for i in range(n):
        k = first_index + i
        keys = tuple(hash((seed, (1 << 40) + k, b)) for b in range(int(prompts[i]) // block_tokens))  # ints: the same in every process
        out.append(SimRequest(k, float(times[i]), int(prompts[i]), int(outputs[i]), keys, slos_ms, group=group))
    return out

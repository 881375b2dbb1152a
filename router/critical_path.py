"""The per-request critical path: its stages, a window of recent requests, and the breakdown of it.

A request's stages partition its end-to-end latency at the router (docs/operations.md):
  router_queue      router: arrival -> the Decode call (validation, tokenization, admission, pick)
  decode_admission  decode worker: waiting for KV blocks
  prefill_queue     prefill worker (or D with local prefill): call received -> the prompt's first step
  prefill_compute   same process: first step -> first token sampled
  kv_transfer       prefill worker: first token -> every decode rank acknowledged the KV (exposed)
  first_token       router: prefill answer -> the first token (D commits the KV and sends it)
  decode            router: first token -> the sequence's last message (ITL = decode / (tokens - 1))
  other             router: e2e minus all of the above (RPC, network, failed attempts)
Each is a duration on one process's clock; `other` is the honest remainder, so the stages add up
to e2e. `Progress.final` fills them (`close_path`); when a request's last sequence ends the router
observes them (`pdserve_request_stage_seconds{stage}`) and `CriticalPathWindow.record` keeps the
request for `breakdown(window_s)`, together with every worker's step-time counters from its
heartbeats (`observe_workers`): their deltas over the window are the busy fractions the verdict
(router.verdict) estimates the colocated cost from, and, with no prefill worker, the decode workers'
prompt steps it estimates a split from. Entries older than `horizon_s` are dropped.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections import deque
from dataclasses import dataclass

from proto.pdserve.v1 import pdserve_pb2 as pb
from router.verdict import HOP, PoolBusy, WorkerSteps, judge, judge_colocated

STAGES = ("router_queue", "decode_admission", "prefill_queue", "prefill_compute", "kv_transfer", "first_token", "decode", "other")
MEASURED = STAGES[:-1]


def close_path(timings: pb.StageTimings, arrived: float, prefill_done_at: float | None, now: float) -> None:
    """Fill the router's stages of a sequence that ends `now`: e2e, first_token, decode and the remainder."""
    timings.e2e_s = now - arrived
    first = arrived + timings.ttft_s if timings.ttft_s else None
    timings.decode_s = now - first if first is not None else 0.0
    timings.first_token_s = first - prefill_done_at if first is not None and prefill_done_at is not None else 0.0
    timings.other_s = timings.e2e_s - sum(getattr(timings, f"{s}_s") for s in MEASURED)


def stages_of(timings: pb.StageTimings) -> dict[str, float]:
    return {s: getattr(timings, f"{s}_s") for s in STAGES}


def critical_path_json(timings: pb.StageTimings) -> dict:
    """The OpenAI extension's object: every stage in seconds (`<stage>_s`), ttft_s, e2e_s, local_prefill, and the
    prompt's KV blocks the decode worker reused and those that moved."""
    return {**{f"{s}_s": v for s, v in stages_of(timings).items()}, "ttft_s": timings.ttft_s, "e2e_s": timings.e2e_s,
            "local_prefill": timings.local_prefill, "kv_blocks_reused": timings.kv_blocks_reused, "kv_blocks_moved": timings.kv_blocks_moved}


@dataclass(frozen=True)
class RequestPath:
    finished_at: float
    stages: dict[str, float]
    e2e_s: float
    ttft_s: float
    completion_tokens: int
    local_prefill: bool

    @property
    def itl_s(self) -> float | None:
        return self.stages["decode"] / (self.completion_tokens - 1) if self.completion_tokens > 1 else None


@dataclass(frozen=True)
class StepSample:
    at: float
    """router's time.monotonic() when seen"""
    role: str
    stamp_s: float
    """the worker's own timestamp of the stats (only its differences are used)"""
    step_seconds: float
    steps: int = 0
    prompt_steps: int = 0
    prompt_step_seconds: float = 0.0


class CriticalPathWindow:
    def __init__(self, horizon_s: float = 300.0, clock=time.monotonic):
        self.horizon_s, self.clock = horizon_s, clock
        self.paths: deque[RequestPath] = deque()
        self.steps: dict[str, deque[StepSample]] = {}

    def record(self, timings: pb.StageTimings, completion_tokens: int) -> None:
        now = self.clock()
        self.paths.append(RequestPath(now, stages_of(timings), timings.e2e_s, timings.ttft_s, completion_tokens, timings.local_prefill))
        while self.paths and self.paths[0].finished_at < now - self.horizon_s:
            self.paths.popleft()

    def observe_workers(self, workers) -> None:
        """router.pool.Worker objects: keeps each one's step-time counter whenever its stats change."""
        now = self.clock()
        for w in workers:
            if w.stats is None or not w.stats.timestamp_s:
                continue
            samples = self.steps.setdefault(w.worker_id, deque())
            if not samples or samples[-1].stamp_s != w.stats.timestamp_s:
                st = w.stats
                samples.append(StepSample(now, w.role, st.timestamp_s, st.step_seconds, st.steps, st.prompt_steps, st.prompt_step_seconds))
            while len(samples) > 2 and samples[1].at < now - self.horizon_s:
                samples.popleft()
        for gone in set(self.steps) - {w.worker_id for w in workers}:
            del self.steps[gone]

    def _spans(self, window_s: float) -> list[tuple[StepSample, StepSample]]:
        """Each worker's (first, last) samples over the window, where its clock moved."""
        since = self.clock() - window_s
        spans = []
        for samples in self.steps.values():
            base = next((s for s in reversed(samples) if s.at <= since), samples[0])
            if samples[-1].stamp_s > base.stamp_s:
                spans.append((base, samples[-1]))
        return spans

    def busy(self, window_s: float) -> PoolBusy:
        """Each pool's summed busy fraction over the window: step seconds run per second of the worker's clock."""
        fractions: dict[str, list[float]] = {"prefill": [], "decode": []}
        for base, last in self._spans(window_s):
            if last.role in fractions:
                fractions[last.role].append(max(0.0, last.step_seconds - base.step_seconds) / (last.stamp_s - base.stamp_s))
        return PoolBusy(sum(fractions["prefill"]), sum(fractions["decode"]), len(fractions["prefill"]), len(fractions["decode"]))

    def decode_steps(self, window_s: float) -> list[WorkerSteps]:
        """Each decode worker's step counters over the window (deltas)."""
        return [WorkerSteps(last.stamp_s - base.stamp_s, last.steps - base.steps, last.step_seconds - base.step_seconds,
                            last.prompt_steps - base.prompt_steps, last.prompt_step_seconds - base.prompt_step_seconds)
                for base, last in self._spans(window_s) if last.role == "decode"]

    def hop_s(self) -> float | None:
        """The mean hop (HOP's stages) of the split requests kept (`horizon_s`); None when none was split."""
        split = [p for p in self.paths if not p.local_prefill]
        return sum(p.stages[s] for p in split for s in HOP) / len(split) if split else None

    def window(self, window_s: float) -> list[RequestPath]:
        since = self.clock() - window_s
        return [p for p in self.paths if p.finished_at >= since]

    def breakdown(self, window_s: float = 60.0) -> dict:
        """The last `window_s` seconds: per-stage p50 / mean / share of e2e, the verdict, and each pool's summed
        busy fraction (`busy`: PoolBusy's fields; the adaptive controller reads it)."""
        paths = self.window(window_s)
        busy = self.busy(window_s)
        if busy.prefill_workers:
            verdict = judge([p for p in paths if not p.local_prefill], busy, in_flight(paths))
        else:  # every prompt prefilled on its decode worker: the split is the side to estimate
            verdict = judge_colocated([p for p in paths if p.local_prefill], self.decode_steps(window_s), self.hop_s())
        report: dict = {"window_s": window_s, "requests": len(paths), "local_prefill": sum(p.local_prefill for p in paths),
                        "stages": {}, "verdict": verdict.as_dict(), "busy": dataclasses.asdict(busy)}
        if not paths:
            return report
        total = sum(p.e2e_s for p in paths)
        for stage in STAGES:
            values = [p.stages[stage] for p in paths]
            report["stages"][stage] = {"p50_s": statistics.median(values), "mean_s": statistics.fmean(values),
                                       "share": sum(values) / total if total > 0 else 0.0}
        itls = [p.itl_s for p in paths if p.itl_s is not None]
        report["e2e"] = {"p50_s": statistics.median(p.e2e_s for p in paths), "mean_s": total / len(paths)}
        report["ttft"] = {"p50_s": statistics.median(p.ttft_s for p in paths), "mean_s": statistics.fmean(p.ttft_s for p in paths)}
        report["itl"] = {"mean_s": statistics.fmean(itls) if itls else 0.0}
        return report


def in_flight(paths: list[RequestPath]) -> float:
    """Mean requests in flight while these ran (Little's law): their summed e2e over the span they cover."""
    if not paths:
        return 0.0
    span = max(p.finished_at for p in paths) - min(p.finished_at - p.e2e_s for p in paths)
    return sum(p.e2e_s for p in paths) / span if span > 0 else 1.0

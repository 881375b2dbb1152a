"""Does disaggregation pay right now? The colocated cost of the same requests, estimated from measures.

`judge(paths, busy)` takes the critical paths of the requests that went through a prefill worker
(router.critical_path.RequestPath) and the workers' busy fractions from their measured step times
(`PoolBusy`), and weighs, request by request, what colocation would save against what it would add:
  - saved: the KV transfer exposed after the forward, the first-token hop (D commits the KV and
    sends the token), the second admission (on D), and half of `other` (one of the two round trips);
  - added: interference. A colocated worker runs the prefill chunks interleaved with its decode
    steps. Spread over all N = P + D workers, a worker is busy prefilling a fraction
    rho_p = (sum of the prefill workers' busy fractions) / N of the time; the share of it that is
    other requests' work (the one a stream can meet; its own prefill precedes its decode) is
    1 - 1/L, L the mean number of requests in flight (Little: sum of e2e / the window's span).
    Each decode stream is stretched by the others' prefill compute it absorbs:
    decode * r_p / (1 - r_p), r_p = rho_p (1 - 1/L); the same way a prompt shares its steps with
    the others' decodes: prefill_compute * r_d / (1 - r_d), r_d = rho_d (1 - 1/L).
The verdict compares the mean measured end-to-end latency with the mean estimate: "pays" when
disaggregation is faster, "does not pay" when it is not; `margin` is the relative difference
(a few % is within the noise of a loaded machine), `deciding_stage` names the largest term on the
winning side, and `reason` says it in words. A pool that would be saturated colocated
(rho_p + rho_d >= `SATURATED`) makes disaggregation pay.

`judge_colocated(paths, steps, hop_s)` answers the same question from the other side when the pool has
no prefill worker (every prompt prefilled on its decode worker): what would a split of these workers cost? Each decode worker's step counters over the window (`WorkerSteps`) tell
what its prompts added to the steps they shared with decode streams: the steps that ran prompt tokens
took `prompt_seconds`; at the decode-only steps' mean they would have taken `prompt_steps * mean`;
the rest is prompt work. With the split, one worker runs all of it (`prefill_busy`: its busy fraction;
at `SATURATED` the split does not pay: its queue would only grow) and the decode streams no longer wait
for it: their decode stage shrinks by the prompt work's share of the decode workers' step time. The
split adds a queue at the one prefill worker (Poisson arrivals at that load, the measured prefill
computes as service times: Pollaczek-Khinchine's busy * E[S^2] / (2 E[S] (1 - busy))) in place of the
measured local queue, and the hop (`hop_s`: KV transfer, first token and decode admission, the mean
of the split requests the router still keeps, 0 when it has none). The decode workers'
decode-only steps are taken to cost the same with the streams of one worker more (a small-batch step
reads the weights; its rows add little), which the controller's ITL check after the split corrects.
The same figures give the split's ITL (the decode-only step time) and mean TTFT (`SplitEstimate`), which
the adaptive controller holds against the SLOs: the verdict weighs mean latency, goodput is SLOs.
"""

from __future__ import annotations

import dataclasses
from dataclasses import asdict, dataclass

SATURATED = 0.95

SAVED = ("kv_transfer", "first_token", "decode_admission", "other")
HOP = ("kv_transfer", "first_token", "decode_admission")
"""A split request's stages that a colocated one does not have."""


@dataclass(frozen=True)
class PoolBusy:
    """Busy fractions (step seconds per second) summed over each pool's workers, and their counts."""

    prefill: float
    decode: float
    prefill_workers: int
    decode_workers: int

    @property
    def workers(self) -> int:
        return self.prefill_workers + self.decode_workers


@dataclass(frozen=True)
class WorkerSteps:
    """One decode worker's step counters over the window (deltas) and the span of its clock they cover."""

    span_s: float
    steps: int
    seconds: float
    prompt_steps: int
    prompt_seconds: float

    @property
    def prompt_work_s(self) -> float:
        """What the prompts added to the steps that ran them, beyond the decode-only steps' mean."""
        decode_steps = self.steps - self.prompt_steps
        mean = (self.seconds - self.prompt_seconds) / decode_steps if decode_steps > 0 else 0.0
        return max(0.0, self.prompt_seconds - self.prompt_steps * mean)


@dataclass(frozen=True)
class SplitEstimate:
    """What a split of colocated workers would give, per request (judge_colocated): the controller holds it against the SLOs."""

    itl_s: float
    """A stream's ITL once no prompt shares its steps: the decode workers' decode-only step time, grown in proportion
    to the streams each of the n - 1 workers left carries (n / (n - 1) as many). Proportional is the cautious side, and
    it is the CPU's regime (a compute-bound step); taking the step as flat (until 2026-12-07) split colocated
    workers in the middle of a decode-heavy phase and left one worker with every stream (adaptive trace at af61e29)."""
    ttft_s: float
    """Mean TTFT through one prefill worker: router queue, prefill compute, its queue at `prefill_busy`, the hop."""
    prefill_busy: float
    """That worker's busy fraction: the prompts' work on the decode workers, summed."""


@dataclass(frozen=True)
class Verdict:
    verdict: str
    """"pays" | "does not pay" | "no data"."""
    reason: str
    deciding_stage: str = ""
    requests: int = 0
    disaggregated_e2e_s: float = 0.0
    colocated_e2e_s: float | None = None
    """None: colocated workers would be saturated (no finite estimate)."""
    margin: float = 0.0
    """(colocated - disaggregated) / disaggregated: > 0 when disaggregation pays."""
    saved_s: dict[str, float] | None = None
    """Mean per request, by stage: what colocation would not pay."""
    added_s: dict[str, float] | None = None
    """Mean per request, by stage: what colocation's interference would add."""
    prefill_busy: float = 0.0
    decode_busy: float = 0.0
    in_flight: float = 0.0
    estimated: str = "colocated"
    """The side that is estimated from the measured one: "colocated" (judge) or "disaggregated" (judge_colocated)."""
    split: SplitEstimate | None = None
    """judge_colocated's estimate of the split's ITL and TTFT (None where the prompts would saturate one worker)."""

    def as_dict(self) -> dict:
        return asdict(self)


def judge(paths: list, busy: PoolBusy, in_flight: float) -> Verdict:
    """`paths`: RequestPath-like objects (`stages` dict, `e2e_s`) of disaggregated requests; `in_flight`:
    the mean number of requests in flight over the window (all of them, local prefills too)."""
    if not paths:
        return Verdict("no data", "no request went through a prefill worker in the window")
    if busy.workers == 0 or busy.prefill_workers == 0:
        return Verdict("no data", "no step times from the prefill and decode workers in the window", requests=len(paths))
    rho_p, rho_d = busy.prefill / busy.workers, busy.decode / busy.workers
    n = len(paths)
    saved = {s: sum(p.stages.get(s, 0.0) for p in paths) / n for s in SAVED}
    saved["other"] /= 2
    disaggregated = sum(p.e2e_s for p in paths) / n
    common = dict(requests=n, disaggregated_e2e_s=disaggregated, saved_s=saved, prefill_busy=rho_p, decode_busy=rho_d, in_flight=in_flight)
    if rho_p + rho_d >= SATURATED:
        return Verdict("pays", f"colocated workers would be saturated: {rho_p:.0%} prefill + {rho_d:.0%} decode of each "
                       "worker's time", deciding_stage="prefill_compute", added_s={}, **common)
    others = max(0.0, 1 - 1 / in_flight) if in_flight > 0 else 0.0
    r_p, r_d = rho_p * others, rho_d * others
    added = {"decode": sum(p.stages.get("decode", 0.0) for p in paths) / n * r_p / (1 - r_p),
             "prefill_compute": sum(p.stages.get("prefill_compute", 0.0) for p in paths) / n * r_d / (1 - r_d)}
    colocated = disaggregated - sum(saved.values()) + sum(added.values())
    return _weigh(Verdict("", "", colocated_e2e_s=colocated, added_s=added, **common))


def judge_colocated(paths: list, steps: list[WorkerSteps], hop_s: float | None) -> Verdict:
    """`paths`: RequestPath-like objects of requests that prefilled on their decode worker; `steps`: each decode
    worker's counters over the window; `hop_s`: the split's measured hop per request (None: never measured, 0)."""
    steps = [w for w in steps if w.span_s > 0]
    if not paths:
        return Verdict("no data", "no request prefilled on its decode worker in the window")
    if len(steps) < 2:
        return Verdict("no data", "fewer than two decode workers with step times in the window: none to split off",
                       requests=len(paths))
    n = len(paths)
    prompt_work = sum(w.prompt_work_s for w in steps)
    load = sum(w.prompt_work_s / w.span_s for w in steps)
    decode_busy = sum((w.seconds - w.prompt_work_s) / w.span_s for w in steps) / len(steps)
    decode_steps = sum(w.steps - w.prompt_steps for w in steps)
    decode_step_s = sum(w.seconds - w.prompt_seconds for w in steps) / decode_steps if decode_steps else 0.0
    share = prompt_work / max(sum(w.seconds for w in steps), 1e-9)
    colocated = sum(p.e2e_s for p in paths) / n
    common = dict(requests=n, colocated_e2e_s=colocated, prefill_busy=load, decode_busy=decode_busy, in_flight=0.0,
                  estimated="disaggregated")
    if load >= SATURATED:
        return Verdict("does not pay", f"one prefill worker would be saturated: the prompts took {load:.0%} of a worker's time "
                       f"over {n} requests; colocated, every worker prefills", deciding_stage="prefill_queue", margin=-1.0, **common)
    mean = {s: sum(p.stages.get(s, 0.0) for p in paths) / n for s in ("router_queue", "prefill_queue", "prefill_compute", "decode")}
    second_moment = sum(p.stages.get("prefill_compute", 0.0) ** 2 for p in paths) / n
    queue = load * second_moment / (2 * mean["prefill_compute"] * (1 - load)) if mean["prefill_compute"] > 0 else 0.0
    hop = hop_s or 0.0
    saved = {"kv_transfer": hop, "prefill_queue": max(0.0, queue - mean["prefill_queue"])}
    added = {"decode": mean["decode"] * share, "prefill_queue": max(0.0, mean["prefill_queue"] - queue)}
    disaggregated = colocated - added["decode"] + queue - mean["prefill_queue"] + hop
    note = "" if hop_s is not None else " (no split measured yet: the hop taken as 0)"
    streams_per_worker = len(steps) / (len(steps) - 1)  # one of the decode workers becomes the prefill worker
    split = SplitEstimate(decode_step_s * streams_per_worker, mean["router_queue"] + queue + mean["prefill_compute"] + hop, load)
    return _weigh(Verdict("", note, disaggregated_e2e_s=disaggregated, saved_s=saved, added_s=added, split=split, **common))


def _weigh(v: Verdict) -> Verdict:
    """The verdict, deciding stage and reason for figures already estimated (`v.reason`: a note to append)."""
    margin = (v.colocated_e2e_s - v.disaggregated_e2e_s) / v.disaggregated_e2e_s if v.disaggregated_e2e_s > 0 else 0.0
    saved, added = v.saved_s or {}, v.added_s or {}
    measured, estimate = ("disaggregated", "colocated (estimated)") if v.estimated == "colocated" else ("colocated", "split (estimated)")
    first, second = (v.disaggregated_e2e_s, v.colocated_e2e_s) if v.estimated == "colocated" else (v.colocated_e2e_s, v.disaggregated_e2e_s)
    figures = f"{measured} {first * 1e3:.0f} ms vs {estimate} {second * 1e3:.0f} ms per request ({margin:+.1%}) over {v.requests} requests"
    costs = ", ".join(f"{s} {t * 1e3:.1f} ms" for s, t in saved.items())
    if v.estimated == "colocated":
        interference = (f"ITL stretched by prefill {added['decode'] * 1e3:.1f} ms, prefill stretched by decode "
                        f"{added['prefill_compute'] * 1e3:.1f} ms; each worker {v.prefill_busy:.0%} prefill + {v.decode_busy:.0%} "
                        f"decode busy, {v.in_flight:.1f} requests in flight")
    else:
        interference = (f"decode stretched by the local prompts {added['decode'] * 1e3:.1f} ms, local prefill queue "
                        f"{added['prefill_queue'] * 1e3:.1f} ms beyond a prefill worker's; the prompts take {v.prefill_busy:.0%} "
                        f"of one worker, decode {v.decode_busy:.0%} of each")
    if margin > 0:
        verdict, stage = "pays", max(added, key=added.__getitem__)
        why = f"{figures}: colocation's interference ({interference}) would cost more than the split does ({costs})"
    else:
        verdict, stage = "does not pay", max(saved, key=saved.__getitem__)
        why = f"{figures}: the split's own cost ({costs}) exceeds the interference it avoids ({interference})"
    return dataclasses.replace(v, verdict=verdict, reason=f"{why}; deciding stage: {stage}{v.reason}", deciding_stage=stage, margin=margin)

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
"""

from __future__ import annotations

import dataclasses
from dataclasses import asdict, dataclass

SATURATED = 0.95

SAVED = ("kv_transfer", "first_token", "decode_admission", "other")
ADDED = ("decode", "prefill_compute")


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


def _weigh(v: Verdict) -> Verdict:
    """The verdict, deciding stage and reason for figures already estimated."""
    margin = (v.colocated_e2e_s - v.disaggregated_e2e_s) / v.disaggregated_e2e_s if v.disaggregated_e2e_s > 0 else 0.0
    saved, added = v.saved_s or {}, v.added_s or {}
    figures = (f"disaggregated {v.disaggregated_e2e_s * 1e3:.0f} ms vs colocated (estimated) {v.colocated_e2e_s * 1e3:.0f} ms "
               f"per request ({margin:+.1%}) over {v.requests} requests")
    costs = ", ".join(f"{s} {saved[s] * 1e3:.1f} ms" for s in SAVED)
    interference = (f"ITL stretched by prefill {added['decode'] * 1e3:.1f} ms, prefill stretched by decode "
                    f"{added['prefill_compute'] * 1e3:.1f} ms; each worker {v.prefill_busy:.0%} prefill + {v.decode_busy:.0%} "
                    f"decode busy, {v.in_flight:.1f} requests in flight")
    if margin > 0:
        verdict, stage = "pays", max(ADDED, key=added.__getitem__)
        why = f"{figures}: colocation's interference ({interference}) would cost more than the split does ({costs})"
    else:
        verdict, stage = "does not pay", max(SAVED, key=saved.__getitem__)
        why = f"{figures}: the split's own cost ({costs}) exceeds the interference it avoids ({interference})"
    return dataclasses.replace(v, verdict=verdict, reason=f"{why}; deciding stage: {stage}", deciding_stage=stage, margin=margin)

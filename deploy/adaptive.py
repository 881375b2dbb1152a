"""The adaptive controller's policy: one snapshot of signals in, one plan out. Pure logic; no Ray, no I/O.

With `autoscaler.adaptive.mode: adaptive` the controller (deploy/controller.py) builds a `Snapshot`
every `autoscaler.interval_s` (each pool's `PoolSignals`, the router's critical-path verdict and
stage shares, its local-prefill threshold) and asks `AdaptivePolicy.decide()`; it carries out the
`Plan` (threshold to the router, a role switch, a resize) and logs it as an event with its inputs.

Two lanes, each with its own hysteresis (a candidate acts only once it came out of `hold_intervals`
consecutive snapshots, and no sooner than its cooldown after the lane's last action):
  threshold  the router's local-prefill threshold, in steps of `local_prefill_step` within
             [0, local_prefill_max]: raised when disaggregation does not pay (more requests prefill
             on their decode worker, colocated) and decode has room; lowered when it pays or when
             decode is pressed (local prefills interfere with decoding).
  split      the P/D split and the pool sizes. Each pool's pressure is the per-pool autoscaler's
             (deploy/autoscaler.py: queued tokens, TTFT / KV, running, ITL against thresholds and SLOs)
             plus its waiting stage's share of e2e (prefill_queue, decode_admission) over
             `queue_share`. A pressed pool takes a worker from the other pool by a role switch
             when that pool stays below its thresholds with one worker fewer and both stay within
             [min_replicas, max_replicas]; only otherwise does the pool's autoscaler resize it
             (a shrink only where the pool could give the worker away, see `_can_shrink`).

Decode headroom is its latency and KV, not its busy fraction: more prompts go to decode workers only while every
decode pressure (ITL against its SLO, KV, running) stays below `DECODE_ROOM`, and a decode pool gives a worker only
if its ITL, spread over the ones left, stays within the SLO. KV blocks a decode worker reserved for a request still
waiting for its prompt's KV (`PoolSignals.kv_waiting`) are not decode load: they count as the prefill pool's pressure
(`decode_kv_waiting`). A new worker is added only onto free cores (`Snapshot.free_cpus`, the controller's count of
cores no worker or router holds): a worker on a machine whose cores are all held slows every other one. When
disaggregation does not pay with the threshold at its max, a prefill worker becomes decode (the colocated shape),
and so does the only prefill worker when it is saturated (`SATURATED`) and pressed with no free core for a second one (its queue
grows while the decode worker's core has time; colocated, every core prefills). With no prefill worker, TTFT over its
SLO is the prefill pool's (every prompt prefilled locally), so a decode worker that can be spared comes back as a
prefill worker, unless those workers are saturated on held cores (the split would only move the same time). With
no prefill worker and decode over its ITL SLO, a decode worker becomes prefill when the router's estimate of the split,
from the decode workers' prompt steps (router.verdict.judge_colocated), keeps ITL and TTFT within their SLOs: the
local prompts stretch every stream, and one worker could run them all (the DistServe regime: prompts among streams
read as they come, under a tight ITL).

Where the pressures come from: the prefill pool's TTFT and prefill_queue share are router-wide, so
they count only for the share of requests that went through a prefill worker (`local_share` went
local). The workers' busy fractions (engine step time per second, from the router's critical-path
window) tell the policy whether the prefill pool has time: a prefill pool that is pressed while decode has room
(below `DECODE_ROOM`, above) but no worker to spare raises the threshold (decode workers prefill more prompts);
a pool whose workers are idle (below `idle_busy`) gives one to the other pool when that one is
pressed (busy alone is no need: a decode engine steps whenever it has a stream); a pool gives a
worker only if the ones left stay below `busy_high`. The verdict and the prefill pool's room meet in
the threshold: a pressed prefill pool sends prompts to decode workers while the verdict does not
say the split pays (local prefills would stretch the decode streams more than the split costs) or
when its workers are saturated (at `busy_high`: its queue only grows, whatever the interference),
and a "pays" verdict sends prompts back to the prefill pool only while that pool is not pressed and
its workers have time (the verdict weighs interference, not the prefill pool's queue).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

from deploy.autoscaler import LOAD_SIGNALS, PoolAutoscaler, PoolSignals
from router.verdict import SATURATED, SplitEstimate

if TYPE_CHECKING:
    from common.config import AutoscalerConfig, PoolsConfig

ROLES = ("prefill", "decode")
DECODE_ROOM = 0.8
"""Decode has room for more local prefills while each of its pressures (ITL against its SLO, KV usage, running
requests against their thresholds) stays below this: the engine's busy fraction says nothing (it steps whenever it
has a stream), its latency against the SLO does."""
WAITING_STAGE = {"prefill": "prefill_queue", "decode": "decode_admission"}
SPLIT_ROOM = 0.8
"""Colocated workers split only if the split's estimated ITL and mean TTFT stay below this share of their SLOs (the
estimates are means, the step grown in proportion to the streams per decode worker; the SLOs are quantiles)."""


@dataclass(frozen=True)
class Snapshot:
    """What the controller saw at `now` (monotonic seconds)."""

    now: float
    prefill: PoolSignals
    decode: PoolSignals
    local_prefill_threshold: int = 0
    verdict: str = "no data"
    """router.verdict: "pays" | "does not pay" | "no data"."""
    margin: float = 0.0
    shares: dict[str, float] = field(default_factory=dict)
    """Critical-path stage -> its share of the window's e2e latency."""
    pool_busy: bool = False
    """A pool operation (scale, switch) is in flight: the split lane waits."""
    busy: dict[str, float] = field(default_factory=dict)
    """Pool -> the mean busy fraction of its workers (engine step seconds per second) over the window;
    absent: no step times from that pool."""
    local_share: float = 0.0
    """The share of the window's requests that prefilled on their decode worker (0..1)."""
    free_cpus: float | None = None
    """Cores the router and the workers do not hold (the controller's count); None: unknown, no limit."""
    split: SplitEstimate | None = None
    """With no prefill worker: the router's estimate of a split's ITL, TTFT and prefill load (router.verdict)."""

    @classmethod
    def from_router(cls, now: float, prefill: PoolSignals, decode: PoolSignals, summary: dict, pool_busy: bool = False,
                    free_cpus: float | None = None) -> Snapshot:
        """`summary`: the router actor's summary() (its critical_path breakdown and local_prefill_threshold)."""
        cp = summary.get("critical_path") or {}
        verdict = cp.get("verdict") or {}
        return cls(now, prefill, decode, summary.get("local_prefill_threshold", 0), verdict.get("verdict", "no data"),
                   verdict.get("margin", 0.0), {s: f["share"] for s, f in (cp.get("stages") or {}).items()}, pool_busy,
                   per_worker_busy(cp.get("busy") or {}), cp.get("local_prefill", 0) / cp["requests"] if cp.get("requests") else 0.0,
                   free_cpus, SplitEstimate(**verdict["split"]) if verdict.get("split") else None)

    def signals(self, role: str) -> PoolSignals:
        return self.prefill if role == "prefill" else self.decode

    def shape(self) -> str:
        return f"{self.prefill.replicas}P/{self.decode.replicas}D, local prefill <= {self.local_prefill_threshold} tokens"

    def inputs(self) -> dict:
        return {k: v for k, v in asdict(self).items() if k != "now"}


@dataclass(frozen=True)
class Plan:
    """What to do now; all None: keep everything. `reasons` explain actions and what is held back."""

    local_prefill_threshold: int | None = None
    switch_to: str | None = None
    """A worker of the other pool takes this role."""
    resize: tuple[str, int] | None = None
    """(pool, replicas)."""
    reasons: tuple[str, ...] = ()
    pressure: dict[str, dict[str, float]] = field(default_factory=dict)

    def shape(self, s: Snapshot) -> str:
        """The split and threshold once the plan is carried out."""
        n = {role: s.signals(role).replicas for role in ROLES}
        if self.switch_to is not None:
            n[self.switch_to] += 1
            n[ROLES[1 - ROLES.index(self.switch_to)]] -= 1
        if self.resize is not None:
            n[self.resize[0]] = self.resize[1]
        t = s.local_prefill_threshold if self.local_prefill_threshold is None else self.local_prefill_threshold
        return Snapshot(s.now, PoolSignals(n["prefill"]), PoolSignals(n["decode"]), t).shape()

    @property
    def acts(self) -> bool:
        return self.local_prefill_threshold is not None or self.switch_to is not None or self.resize is not None


@dataclass(frozen=True)
class Candidate:
    key: tuple
    """What must stay the same over the held intervals: the kind, the pool, the direction."""
    reason: str
    value: object = None
    """The new threshold, the role switched to, or (pool, replicas)."""


class Lane:
    """Hysteresis of one kind of decision: the same candidate for `hold` snapshots, then a cooldown."""

    def __init__(self, name: str, hold: int, cooldown_s: float):
        self.name, self.hold, self.cooldown_s = name, hold, cooldown_s
        self.key: tuple | None = None
        self.streak = 0
        self.last_action = -math.inf

    def ready(self, now: float, candidate: Candidate | None) -> tuple[bool, str]:
        """Whether `candidate` acts now, and why it does not yet."""
        if candidate is None:
            self.key, self.streak = None, 0
            return False, ""
        self.streak = self.streak + 1 if candidate.key == self.key else 1
        self.key = candidate.key
        if self.streak < self.hold:
            return False, f"{self.name}: holding ({self.streak}/{self.hold}) {candidate.reason}"
        if now - self.last_action < self.cooldown_s:
            return False, f"{self.name}: cooling down ({now - self.last_action:.0f}/{self.cooldown_s:.0f} s) {candidate.reason}"
        self.key, self.streak, self.last_action = None, 0, now
        return True, f"{self.name}: {candidate.reason}"


class AdaptivePolicy:
    def __init__(self, config: AutoscalerConfig, pools: PoolsConfig, now: float):
        """`now`: the start (monotonic seconds); a fresh pool does not shrink before a downscale cooldown."""
        self.config, self.pools = config, pools
        self.now = now
        self.scalers = {role: PoolAutoscaler(role, config, getattr(pools, role), clock=lambda: self.now) for role in ROLES}
        cfg = config.adaptive
        self.threshold_lane = Lane("local prefill", cfg.hold_intervals, cfg.threshold_cooldown_s)
        self.split_lane = Lane("split", cfg.hold_intervals, cfg.action_cooldown_s)
        self.last: Plan = Plan()

    def decide(self, s: Snapshot) -> Plan:
        self.now = s.now
        pressure = {role: self.pressure(role, s) for role in ROLES}
        threshold, why_t = self._lane(self.threshold_lane, s, self._threshold(s, pressure))
        split, why_s = self._lane(self.split_lane, s, None if s.pool_busy else self._split(s, pressure))
        plan = Plan(local_prefill_threshold=threshold.value if threshold else None,
                    switch_to=split.value if split and split.key[0] == "switch" else None,
                    resize=split.value if split and split.key[0] == "resize" else None,
                    reasons=tuple(r for r in (why_t, why_s) if r), pressure=pressure)
        self.last = plan
        return plan

    def pressure(self, role: str, s: Snapshot) -> dict[str, float]:
        """The pool autoscaler's pressures plus the pool's waiting stage's share of e2e (1.0: at its threshold).
        The prefill pool's router-wide ones (TTFT, prefill_queue) count only for the share of requests it prefilled:
        a prompt that prefilled on its decode worker waited there, not in the prefill pool."""
        stage = WAITING_STAGE[role]
        p = {**self.scalers[role].pressure(s.signals(role)), stage: s.shares.get(stage, 0.0) / self.config.adaptive.queue_share}
        if role == "prefill":
            if s.prefill.replicas > 0:  # with no prefill worker every TTFT is a local prefill's: a prefill worker would take them
                for key in ("ttft", stage):
                    p[key] *= 1.0 - s.local_share
            # decode KV reserved for prompts still waiting for their KV waits on the prefill pool
            p["decode_kv_waiting"] = s.decode.kv_waiting / self.config.decode.kv_usage
        return p

    @staticmethod
    def _lane(lane: Lane, s: Snapshot, candidate: Candidate | None) -> tuple[Candidate | None, str]:
        ready, why = lane.ready(s.now, candidate)
        return (candidate if ready else None), why

    def _threshold(self, s: Snapshot, pressure: dict[str, dict[str, float]]) -> Candidate | None:
        cfg, t = self.config.adaptive, s.local_prefill_threshold
        if s.prefill.replicas == 0:
            return None  # every prompt prefills locally whatever the threshold: the split lane's rules are the lever
        decode_hot = {k: v for k, v in pressure["decode"].items() if v > 1.0}
        if decode_hot and t > 0:
            return Candidate(("threshold", "down"), f"decode pressed ({_hot(decode_hot)}): fewer local prefills, threshold {t} -> lower",
                             max(0, t - cfg.local_prefill_step))
        prefill_hot = {k: v for k, v in pressure["prefill"].items() if v > 1.0}
        decode_room = max(pressure["decode"].values(), default=0.0)
        pays = s.verdict == "pays" and s.margin >= cfg.verdict_margin
        saturated = s.busy.get("prefill", 0.0) >= cfg.busy_high  # the verdict weighs interference, not a queue that only grows
        if (prefill_hot and s.prefill.replicas > 0 and t < cfg.local_prefill_max and decode_room < DECODE_ROOM and (saturated or not pays)
                and not self._can_give("decode", s, pressure["decode"])):
            return Candidate(("threshold", "up"), f"prefill pressed ({_hot(prefill_hot)}, workers {s.busy.get('prefill', 0.0):.0%} busy), "
                             f"decode within its SLO and KV (at most {decode_room:.2f}x) but no worker to spare: threshold {t} -> higher, "
                             "decode workers prefill more prompts", min(cfg.local_prefill_max, t + cfg.local_prefill_step))
        prefill_time = not prefill_hot and s.busy.get("prefill", 0.0) < cfg.busy_high
        if pays and t > 0 and prefill_time:
            return Candidate(("threshold", "down"), f"disaggregation pays ({s.margin:+.1%}): threshold {t} -> lower, more prompts to the "
                             "prefill pool", max(0, t - cfg.local_prefill_step))
        if s.verdict == "does not pay" and s.margin <= -cfg.verdict_margin and not decode_hot and t < cfg.local_prefill_max:
            return Candidate(("threshold", "up"), f"disaggregation does not pay ({s.margin:+.1%}): threshold {t} -> higher, more "
                             "prompts prefill locally", min(cfg.local_prefill_max, t + cfg.local_prefill_step))
        return None

    def _split(self, s: Snapshot, pressure: dict[str, dict[str, float]]) -> Candidate | None:
        decisions = {role: self.scalers[role].decide(s.signals(role)) for role in ROLES}  # keeps their cooldown state
        for role, other in (ROLES, ROLES[::-1]):
            hot = {k: v for k, v in pressure[role].items() if v > 1.0}
            if hot and self._can_give(other, s, pressure[other]) and self._fits(role, s.signals(role).replicas + 1):
                return Candidate(("switch", role), f"{role} pressed ({_hot(hot)}), {other} has room: a {other} worker becomes {role}", role)
        given = self._idle_gives(s, pressure) or self._saturated_split(s, pressure) or self._interference_split(s, pressure)
        if given is not None:
            return given
        cfg = self.config.adaptive
        if (s.verdict == "does not pay" and s.margin <= -cfg.verdict_margin and s.local_prefill_threshold >= cfg.local_prefill_max
                and self._fits("prefill", s.prefill.replicas - 1) and self._fits("decode", s.decode.replicas + 1)
                and all(v <= 1.0 for v in pressure["prefill"].values()) and max(pressure["decode"].values(), default=0.0) < DECODE_ROOM):
            # its prompts go local, as the verdict says they should: neither pool may be pressed already
            return Candidate(("switch", "decode"), f"disaggregation does not pay ({s.margin:+.1%}) with the threshold at its max "
                             f"({s.local_prefill_threshold}): a prefill worker becomes decode (colocated)", "decode")
        changes = [(role, s.signals(role).replicas, d) for role, d in decisions.items() if d and d.replicas != s.signals(role).replicas]
        changes = [(role, n, d) for role, n, d in changes if d.replicas > n or self._can_shrink(role, s, pressure[role])]
        if not changes:
            return None
        role, n, d = min(changes, key=lambda c: c[2].replicas < c[1])  # a pool that grows first
        if d.replicas > n and not self._cores_for(role, d.replicas - n, s):
            changes = [c for c in changes if c[2].replicas < c[1]]  # a shrink may still go ahead
            if not changes:
                return None
            role, n, d = changes[0]
        return Candidate(("resize", role, d.replicas > n), f"{role} {n} -> {d.replicas} workers ({d.reason})", (role, d.replicas))

    def _idle_gives(self, s: Snapshot, pressure: dict[str, dict[str, float]]) -> Candidate | None:
        """A pool whose workers are idle gives one to the other pool when that one is pressed. Pressed, not
        merely busy: a decode engine steps whenever it has a stream, so a busy decode pool may be well within its SLO.
        The only prefill worker does not go for decode's ITL alone while it still prefills most prompts: colocated,
        those prompts' chunks would stretch the same ITL (the inverse of `_interference_split`)."""
        cfg = self.config.adaptive
        for role, other in (ROLES, ROLES[::-1]):
            mine = s.busy.get(role)
            if mine is None or mine >= cfg.idle_busy or any(v > 1.0 for v in pressure[role].values()):
                continue
            pressed = {k: v for k, v in pressure[other].items() if v > 1.0}
            if role == "prefill" and s.prefill.replicas == 1 and set(pressed) == {"itl"} and s.local_share < 0.5:
                continue  # its prompts would come back among the streams: the interference split's inverse, the pair would flap
            if pressed and self._fits(role, s.signals(role).replicas - 1) and self._fits(other, s.signals(other).replicas + 1):
                return Candidate(("switch", other), f"{role} workers idle ({mine:.0%} busy), {other} pressed ({_hot(pressed)}): "
                                 f"a {role} worker becomes {other}", other)
        return None

    def _saturated_split(self, s: Snapshot, pressure: dict[str, dict[str, float]]) -> Candidate | None:
        """The only prefill worker is saturated and pressed, and no core is free for a second one: it becomes decode
        (the colocated shape), so that every worker's spare time goes to prompts instead of one core's queue growing
        while the other core waits on it. The verdict does not hold it back: it weighs interference, and a queue that
        only grows costs more (capacity first, as in the threshold lane)."""
        hot = {k: v for k, v in pressure["prefill"].items() if v > 1.0}
        busy = s.busy.get("prefill", 0.0)
        if (not hot or s.prefill.replicas != 1 or busy < SATURATED or self._cores_for("prefill", 1, s)
                or not (self._fits("prefill", 0) and self._fits("decode", s.decode.replicas + 1))):
            return None
        return Candidate(("switch", "decode"), f"prefill saturated ({_hot(hot)}, workers {busy:.0%} busy) with no free core for "
                         "another prefill worker: it becomes decode (colocated: every worker prefills)", "decode")

    def _interference_split(self, s: Snapshot, pressure: dict[str, float]) -> Candidate | None:
        """Colocated (no prefill worker) and decode over its ITL SLO: the local prompts stretch every stream. A decode
        worker becomes prefill if the router's estimate of the split (`Snapshot.split`) keeps its ITL and TTFT within
        `SPLIT_ROOM` of their SLOs with the prefill worker below `busy_high`, and the streams' KV and count fit the
        decode workers left."""
        est, n = s.split, s.decode.replicas
        itl = pressure["decode"].get("itl", 0.0)
        if (s.prefill.replicas or itl <= 1.0 or est is None or n < 2
                or not (self._fits("prefill", 1) and self._fits("decode", n - 1))):
            return None
        split_itl, split_ttft = est.itl_s / self.config.decode.itl_slo_s, est.ttft_s / self.config.prefill.ttft_slo_s
        if max(split_itl, split_ttft) >= SPLIT_ROOM or est.prefill_busy >= self.config.adaptive.busy_high:
            return None
        if any(pressure["decode"].get(k, 0.0) * n / (n - 1) >= 1.0 for k in ("kv_usage", "running_requests")):
            return None
        return Candidate(("switch", "prefill"), f"decode pressed (itl {itl:.2f}x) by local prompts; a split keeps the SLOs (estimated "
                         f"ITL {split_itl:.2f}x, TTFT {split_ttft:.2f}x, prefill worker {est.prefill_busy:.0%} busy): a decode worker "
                         "becomes prefill", "prefill")

    def _can_give(self, role: str, s: Snapshot, pressure: dict[str, float]) -> bool:
        """`role`'s pool can lose a worker: within min_replicas, and below every threshold with one fewer
        (its workers' busy fraction too: the ones left must still have time for the work)."""
        n = s.signals(role).replicas
        if n < 1 or not self._fits(role, n - 1):
            return False
        spread = n / (n - 1) if n > 1 else math.inf
        # a prefill engine's busy fraction is its load; a decode engine steps whenever it has a stream, so its
        # room is its ITL against the SLO (spread over the workers left like a load) and its KV
        if role == "prefill" and s.busy.get(role, 0.0) * spread >= self.config.adaptive.busy_high:
            return False
        if role == "decode" and s.prefill.replicas == 0 and s.busy.get(role, 0.0) >= self.config.adaptive.busy_high \
                and not self._cores_for("prefill", 1, s):
            return False  # saturated colocated workers on held cores: a split only moves the same cores' time behind a hop
        spreads = LOAD_SIGNALS + (("itl",) if role == "decode" else ())
        return all((v * spread if k in spreads else v) < 1.0 for k, v in pressure.items() if v > 0)

    def _can_shrink(self, role: str, s: Snapshot, pressure: dict[str, float]) -> bool:
        """A pool shrinks (the worker leaves, its work stays with the pool) only if it could give that worker away, and,
        where its busy fraction is its load (a decode pool that prefills every prompt), the workers left keep time."""
        n = s.signals(role).replicas
        if not self._can_give(role, s, pressure):
            return False
        return not (role == "decode" and s.prefill.replicas == 0 and n > 1
                    and s.busy.get(role, 0.0) * n / (n - 1) >= self.config.adaptive.busy_high)

    def _cores_for(self, role: str, workers: int, s: Snapshot) -> bool:
        """Whether `workers` more of `role` fit the free cores: a worker on cores that are all held would slow
        every other one (on 2 cores 1P+2D is the worst shape); unknown free cores do not limit."""
        if s.free_cpus is None:
            return True
        pool = getattr(self.pools, role)
        return s.free_cpus >= workers * pool.num_cpus * pool.tensor_parallel_size

    def _fits(self, role: str, n: int) -> bool:
        pool = getattr(self.pools, role)
        return pool.min_replicas <= n <= pool.max_replicas


def per_worker_busy(busy: dict) -> dict[str, float]:
    """The router's summed busy fractions (router.verdict.PoolBusy as a dict) as a mean per worker of each pool."""
    return {role: busy[role] / busy[f"{role}_workers"] for role in ROLES if busy.get(f"{role}_workers")}


def _hot(pressure: dict[str, float]) -> str:
    return ", ".join(f"{k} {v:.2f}x" for k, v in sorted(pressure.items()))

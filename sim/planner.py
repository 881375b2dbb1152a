"""`pdserve plan`: the fewest accelerators whose simulated cluster meets the SLOs at the target rate.

Lifecycle: `plan(profile, workload, goal, limits) -> Plan`, then `write_config(plan, path)` and `report(plan)`.
  1. Candidates: shapes (P prefill + D decode workers, TP per pool from the profile's `tp_scaling`, the
     routing policies), P = 0 being colocated (every prompt prefilled on its decode worker). An
     accelerator is one rank (a GPU; on a CPU profile, one worker's core).
  2. Search. Few candidates (<= `exhaustive`): every one is simulated at the target rate. Many: for each
     policy and TP pair, the prefill pool is sized first (the fewest P whose TTFT attainment meets the goal
     with a generous decode pool: binary search), then the decode pool with that P (the fewest D meeting
     every SLO), then P grows while the pair misses (the pools interact); colocated by binary search on D.
     A candidate meets the goal when the share of requests meeting every SLO (common/slo.py) is at least
     `attainment` and none is rejected.
  3. The pick: fewest accelerators; among equals, the highest goodput. Each shortlisted candidate (the
     pick and the best miss of every shape family) is also simulated at other rates (x `rate_factors`)
     for the report's goodput-vs-rate table.
The written config is a `pdserve serve -c` YAML (common/config.py load_config validates it here before
it is written). Torch-free.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from sim.cluster import ClusterSpec, simulate
from sim.profile import Profile
from sim.workload import SimRequest

Workload = Callable[[float], list[SimRequest]]
"""Fresh requests at a rate multiplier (1.0 = the target rate)."""


@dataclass(frozen=True)
class Goal:
    slos_ms: dict[str, float]
    attainment: float = 0.9
    """Share of the requests that must meet every SLO."""


@dataclass(frozen=True)
class Limits:
    max_gpus: int
    policies: tuple[str, ...] = ("round_robin", "kv_aware")
    tp: tuple[int, ...] | None = None
    """TP sizes to try per pool; None: the profile's."""
    base: ClusterSpec = field(default_factory=ClusterSpec)
    """Everything a candidate does not choose (cores, KV blocks, budget, tier, block tokens, transport)."""
    exhaustive: int = 48
    rate_factors: tuple[float, ...] = (0.5, 0.75, 1.0, 1.25, 1.5)


@dataclass
class Candidate:
    spec: ClusterSpec
    summary: dict[str, Any]
    attainment: float
    meets: bool
    by_rate: dict[str, dict[str, float]] = field(default_factory=dict)

    def row(self) -> dict[str, Any]:
        s = self.summary
        return {"shape": self.spec.name(), "policy": self.spec.policy, "gpus": self.spec.gpus, "meets": self.meets,
                "attainment": round(self.attainment, 4), "goodput": s["goodput"], "ttft_p50_ms": s["ttft_ms"]["p50"],
                "ttft_p99_ms": s["ttft_ms"]["p99"], "itl_p50_ms": s["itl_ms"]["p50"], "itl_p99_ms": s["itl_ms"]["p99"],
                "rejected": s["rejected"], "reuse": s["reuse"], "goodput_by_rate": self.by_rate}


@dataclass
class Plan:
    chosen: Candidate | None
    candidates: list[Candidate]
    goal: Goal
    limits: Limits
    profile: Profile
    why: str = ""
    simulations: int = 0


class Planner:
    def __init__(self, profile: Profile, workload: Workload, goal: Goal, limits: Limits) -> None:
        self.profile, self.workload, self.goal, self.limits = profile, workload, goal, limits
        self.seen: dict[ClusterSpec, Candidate] = {}

    def evaluate(self, spec: ClusterSpec) -> Candidate:
        if spec not in self.seen:
            summary = simulate(spec, self.profile, self.workload(1.0)).summary
            attainment = summary["good_requests"] / summary["requests"] if summary["requests"] else 0.0
            self.seen[spec] = Candidate(spec, summary, attainment, attainment >= self.goal.attainment and not summary["rejected"])
        return self.seen[spec]

    def tps(self) -> list[int]:
        return sorted(self.limits.tp or self.profile.tp_scaling)

    def shapes(self) -> list[ClusterSpec]:
        base, out = self.limits.base, []
        for policy, tp_p, tp_d in itertools.product(self.limits.policies, self.tps(), self.tps()):
            for p in range(0, self.limits.max_gpus // tp_p + 1):
                if p == 0 and tp_p != self.tps()[0]:
                    continue
                for d in range(1, (self.limits.max_gpus - p * tp_p) // tp_d + 1):
                    out.append(dataclasses.replace(base, prefill=p, decode=d, prefill_tp=tp_p if p else 1, decode_tp=tp_d, policy=policy))
        return list(dict.fromkeys(out))

    def search(self) -> Plan:
        shapes = self.shapes()
        if len(shapes) <= self.limits.exhaustive:
            for spec in shapes:
                self.evaluate(spec)
        else:
            for policy, tp_d in itertools.product(self.limits.policies, self.tps()):
                self._colocated(policy, tp_d)
                for tp_p in self.tps():
                    self._disaggregated(policy, tp_p, tp_d)
        return self._pick()

    def _smallest(self, lo: int, hi: int, meets: Callable[[int], bool]) -> int | None:
        """The least n in [lo, hi] with meets(n), assuming more never hurts; None when hi misses."""
        if hi < lo or not meets(hi):
            return None
        while lo < hi:
            mid = (lo + hi) // 2
            if meets(mid):
                hi = mid
            else:
                lo = mid + 1
        return lo

    def _spec(self, policy: str, p: int, tp_p: int, d: int, tp_d: int) -> ClusterSpec:
        return dataclasses.replace(self.limits.base, prefill=p, decode=d, prefill_tp=tp_p if p else 1, decode_tp=tp_d, policy=policy)

    def _colocated(self, policy: str, tp_d: int) -> None:
        self._smallest(1, self.limits.max_gpus // tp_d, lambda d: self.evaluate(self._spec(policy, 0, 1, d, tp_d)).meets)

    def _disaggregated(self, policy: str, tp_p: int, tp_d: int) -> None:
        budget = self.limits.max_gpus
        generous = max(1, (budget // 2) // tp_d)

        def ttft_ok(p: int) -> bool:
            s = self.evaluate(self._spec(policy, p, tp_p, generous, tp_d)).summary
            return s["ttft_ms"]["p50"] is not None and _share_within(s, self.goal) and not s["rejected"]

        p = self._smallest(1, max(0, (budget - generous * tp_d) // tp_p), ttft_ok)  # the largest P that leaves the generous decode pool
        while p is not None and p * tp_p + tp_d <= budget:
            d = self._smallest(1, (budget - p * tp_p) // tp_d, lambda d, p=p: self.evaluate(self._spec(policy, p, tp_p, d, tp_d)).meets)
            if d is not None:
                return
            p += 1

    def _pick(self) -> Plan:
        candidates = sorted(self.seen.values(), key=lambda c: (not c.meets, c.spec.gpus, -c.summary["goodput"], c.spec.name(), c.spec.policy))
        chosen = candidates[0] if candidates and candidates[0].meets else None
        for c in self._shortlist(candidates, chosen):
            c.by_rate = {f"{f:g}": self._at_rate(c.spec, f) for f in self.limits.rate_factors}
        return Plan(chosen, candidates, self.goal, self.limits, self.profile, self._why(chosen, candidates), len(self.seen))

    def _shortlist(self, candidates: list[Candidate], chosen: Candidate | None) -> list[Candidate]:
        """The pick, and per shape family (colocated / disaggregated, policy) its best candidate."""
        out = [chosen] if chosen else []
        families: dict[tuple, Candidate] = {}
        for c in candidates:
            families.setdefault((c.spec.prefill == 0, c.spec.policy), c)
        return _unique(out + list(families.values()))

    def _at_rate(self, spec: ClusterSpec, factor: float) -> dict[str, float]:
        s = simulate(spec, self.profile, self.workload(factor)).summary
        return {"rate": s["requests"] / s["duration_s"] if s["duration_s"] else 0.0, "goodput": s["goodput"],
                "attainment": s["good_requests"] / s["requests"] if s["requests"] else 0.0}

    def _why(self, chosen: Candidate | None, candidates: list[Candidate]) -> str:
        if chosen is None:
            best = max(candidates, key=lambda c: c.attainment, default=None)
            return (f"no candidate within {self.limits.max_gpus} accelerators meets the goal ({self.goal.attainment:.0%} of requests within "
                    f"{self.goal.slos_ms}); the closest: {best.spec.name()} {best.spec.policy} at {best.attainment:.1%}" if best else "no candidate")
        cheaper = [c for c in candidates if c.spec.gpus < chosen.spec.gpus]
        closest = max(cheaper, key=lambda c: c.attainment, default=None)
        text = (f"{chosen.spec.name()} with {chosen.spec.policy} routing: {chosen.spec.gpus} accelerators, {chosen.attainment:.1%} of requests "
                f"within {self.goal.slos_ms} (goal {self.goal.attainment:.0%}), goodput {chosen.summary['goodput']:.3g} req/s; "
                f"TTFT p50/p99 {_ms(chosen.summary['ttft_ms'])}, ITL p50/p99 {_ms(chosen.summary['itl_ms'])}.")
        if closest:
            text += (f" The best with fewer accelerators, {closest.spec.name()} {closest.spec.policy} ({closest.spec.gpus}), reaches "
                     f"{closest.attainment:.1%}" + (f" with {closest.summary['rejected']} rejected" if closest.summary["rejected"] else "") + ".")
        return text


def _unique(items: list[Candidate]) -> list[Candidate]:
    seen, out = set(), []
    for c in items:
        if id(c) not in seen:
            seen.add(id(c))
            out.append(c)
    return out


def _share_within(summary: dict, goal: Goal) -> bool:
    """TTFT p(attainment) within the TTFT SLO: the prefill pool keeps up (decode judged separately)."""
    ttft = goal.slos_ms.get("ttft")
    return ttft is None or (summary["ttft_ms"]["p50"] <= ttft and summary["completed"] == summary["requests"]
                            and summary["ttft_attainment"] >= goal.attainment)


def _ms(p: dict) -> str:
    return "/".join("-" if p[k] is None else f"{p[k]:.0f}" for k in ("p50", "p99")) + " ms"


def plan(profile: Profile, workload: Workload, goal: Goal, limits: Limits) -> Plan:
    return Planner(profile, workload, goal, limits).search()


# ---- outputs -----------------------------------------------------------------------------------
def serve_config(plan: Plan, model: str | None = None) -> dict[str, Any]:
    """The chosen shape as a `pdserve serve -c` config (validated by common/config.py before it is returned)."""
    from common.config import config_from_dict

    spec, profile = plan.chosen.spec, plan.profile
    gpu = profile.device.startswith("cuda")
    model = model or profile.model or "smollm2-135m"
    engine = {"model": model, "dtype": profile.dtype or "auto", "device": "cuda" if gpu else "cpu", "block_size": profile.block_size,
              "max_num_batched_tokens": spec.max_num_batched_tokens or profile.max_num_batched_tokens, "max_num_seqs": spec.max_num_seqs,
              "enable_chunked_prefill": True, "enable_prefix_caching": True}
    if not gpu:
        engine["kv_cache_memory_mb"] = max(1, profile.kv_capacity_tokens * profile.kv_bytes_per_token // (1 << 20))
    if spec.tier_blocks:
        engine["kv_tier"] = {"kind": "memory", "budget_mb": max(1, spec.tier_blocks * (spec.block_tokens or profile.block_size)
                                                                   * profile.kv_bytes_per_token // (1 << 20))}

    def pool(n: int, tp: int) -> dict[str, Any]:
        out = {"replicas": n, "min_replicas": min(n, 1) if n else 0, "max_replicas": n, "tensor_parallel_size": tp}
        out.update({"num_gpus": 1, "num_cpus": 1} if gpu else {"num_cpus": 1})
        return out

    config = {
        "model_name": model, "engine": engine,
        "kv_transfer": {"transport": "ucx" if gpu else "tcp", "layerwise": spec.layerwise},
        "router": {"policy": spec.policy, "local_prefill_threshold": spec.local_prefill_threshold,
                   "max_queued_requests": spec.max_queued_requests},
        "pools": {"prefill": pool(spec.prefill, spec.prefill_tp), "decode": pool(spec.decode, spec.decode_tp)},
    }
    if not spec.prefill:
        config["pools"]["prefill"] = {"replicas": 0, "min_replicas": 0, "max_replicas": 0, "num_cpus": 1}
    config_from_dict(config)  # raises ConfigError naming the field if the plan wrote something serve would refuse
    return config


def write_config(plan: Plan, path: str | Path, model: str | None = None) -> Path:
    path = Path(path)
    config = serve_config(plan, model)
    header = (f"# Written by `pdserve plan` from profile {plan.profile.path or plan.profile.model}"
              f"{' (an ESTIMATE: see its source)' if plan.profile.estimate else ''}.\n# {plan.why}\n")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(header + yaml.safe_dump(config, sort_keys=False))
    return path


def report(plan: Plan) -> dict[str, Any]:
    return {"chosen": plan.chosen.row() if plan.chosen else None, "why": plan.why, "goal": dataclasses.asdict(plan.goal),
            "max_gpus": plan.limits.max_gpus, "policies": list(plan.limits.policies), "simulations": plan.simulations,
            "profile": {"path": plan.profile.path, "model": plan.profile.model, "device": plan.profile.device,
                        "estimate": plan.profile.estimate, "source": plan.profile.source},
            "candidates": [c.row() for c in plan.candidates]}

"""The on/off switch: speculate only while the measured cost model says it pays.

A step's wall time grows with the tokens in it: `StepCostModel` keeps the recent mean time of steps
per token count and fits t(T) = a + b*T over those points. `AcceptanceTracker` keeps the measured
acceptance rate, globally and per sequence (shrunk towards the global rate until the sequence has
history). Each step, `SpeculationSwitch.choose` ranks every candidate proposed token by its
probability of being kept (alpha^j for the j-th token of a sequence with rate alpha) and keeps the
best-ranked m that maximise expected tokens per second, (outputs + kept gain) / t(T0 + m): at low
load a verified token costs almost nothing and all pay; at a large batch or token budget none does.
Until two token counts have been timed it keeps everything (to measure); when it has kept nothing
for `PROBE_EVERY` steps it keeps one sequence's proposal to refresh the acceptance it relies on.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

PROBE_EVERY = 64
EMA = 0.2
"""Weight of the newest measurement in a moving average."""
PRIOR_WEIGHT = 4.0
"""A sequence's acceptance counts as this many proposed tokens at the global rate before its own."""
MAX_POINTS = 64


class StepCostModel:
    def __init__(self):
        self._mean: OrderedDict[int, float] = OrderedDict()

    def record(self, num_tokens: int, seconds: float) -> None:
        old = self._mean.pop(num_tokens, None)
        self._mean[num_tokens] = seconds if old is None else old + EMA * (seconds - old)
        if len(self._mean) > MAX_POINTS:
            self._mean.popitem(last=False)

    def fit(self) -> tuple[float, float] | None:
        """(a, b) of t(T) = a + b*T, or None until two token counts have been timed."""
        if len(self._mean) < 2:
            return None
        xs, ys = list(self._mean), list(self._mean.values())
        mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
        var = sum((x - mx) ** 2 for x in xs)
        b = max(0.0, sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var)
        return max(my - b * mx, 1e-9), b


@dataclass
class _Rate:
    proposed: float = 0.0
    accepted: float = 0.0


class AcceptanceTracker:
    def __init__(self, initial: float = 0.5):
        self.rate = initial
        self._seqs: dict[str, _Rate] = {}

    def record(self, request_id: str, proposed: int, accepted: int) -> None:
        if proposed:
            self.rate += EMA * (accepted / proposed - self.rate)
            seq = self._seqs.setdefault(request_id, _Rate())
            seq.proposed += proposed
            seq.accepted += accepted

    def rate_of(self, request_id: str) -> float:
        seq = self._seqs.get(request_id, _Rate())
        return (seq.accepted + PRIOR_WEIGHT * self.rate) / (seq.proposed + PRIOR_WEIGHT)

    def forget(self, request_id: str) -> None:
        self._seqs.pop(request_id, None)


class SpeculationSwitch:
    def __init__(self, adaptive: bool):
        self.adaptive = adaptive
        self.cost = StepCostModel()
        self.acceptance = AcceptanceTracker()
        self._idle_steps = 0

    def choose(self, base_tokens: int, num_outputs: int, proposals: dict[str, list[int]]) -> dict[str, int]:
        """How many of each sequence's proposed tokens to verify this step (sequences left out: none).
        base_tokens: the step's tokens without proposals; num_outputs: sequences sampling in it."""
        fit = self.cost.fit()
        if not self.adaptive or fit is None:
            return {rid: len(p) for rid, p in proposals.items() if p}
        gains = sorted(((self.acceptance.rate_of(rid) ** j, rid) for rid, p in proposals.items() for j in range(1, len(p) + 1)),
                       reverse=True)
        a, b = fit
        best_m, best, gain = 0, num_outputs / (a + b * base_tokens), 0.0
        for m, (g, _) in enumerate(gains, 1):
            gain += g
            rate = (num_outputs + gain) / (a + b * (base_tokens + m))
            if rate > best:
                best_m, best = m, rate
        if best_m == 0 and gains:
            self._idle_steps += 1
            if self._idle_steps >= PROBE_EVERY:
                self._idle_steps = 0
                rid = gains[0][1]
                return {rid: len(proposals[rid])}
            return {}
        self._idle_steps = 0
        chosen: dict[str, int] = {}
        for _, rid in gains[:best_m]:
            chosen[rid] = chosen.get(rid, 0) + 1
        return chosen

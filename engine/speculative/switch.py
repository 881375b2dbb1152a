"""The on/off switch: speculate only while the measured cost model says it pays.

A step's wall time grows with the tokens in it: `StepCostModel` keeps the recent mean time of steps
per token count, for plain steps and for steps that verify proposals, and estimates the cost of a
step of any size from them. `AcceptanceTracker` keeps the measured
acceptance rate, globally and per sequence (shrunk towards the global rate until the sequence has
history). Each step, `SpeculationSwitch.choose` ranks every candidate proposed token by its
probability of being kept (alpha^j for the j-th token of a sequence with rate alpha) and keeps the
best-ranked m that maximise expected tokens per second, (outputs + kept gain) / t_spec(T0 + m) against
outputs / t_plain(T0): at low
load a verified token costs almost nothing and all pay; at a large batch or token budget none does.
Until it has timings to estimate from it keeps everything (to measure); when it has kept nothing
for `PROBE_EVERY` steps it keeps one sequence's proposal to refresh the acceptance it relies on.
"""

from __future__ import annotations

import bisect
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

PROBE_EVERY = 64
EMA = 0.2
"""Weight of the newest measurement in a moving average."""
PRIOR_WEIGHT = 4.0
"""A sequence's acceptance counts as this many proposed tokens at the global rate before its own."""
MAX_POINTS = 64


class StepCostModel:
    """Mean step time per token count, kept apart for steps with and without verified proposals (on a
    CPU a step's first extra token costs more than the next ones: it leaves the matrix-vector kernels;
    a verified sequence also takes the chunk attention path). Estimates interpolate between measured
    token counts and extrapolate with the least-squares slope."""

    def __init__(self):
        self._means: dict[bool, OrderedDict[int, float]] = {False: OrderedDict(), True: OrderedDict()}

    def record(self, num_tokens: int, speculative: bool, seconds: float) -> None:
        means = self._means[speculative]
        old = means.pop(num_tokens, None)
        means[num_tokens] = seconds if old is None else old + EMA * (seconds - old)
        if len(means) > MAX_POINTS:
            means.popitem(last=False)

    def curve(self, speculative: bool) -> Callable[[int], float] | None:
        """Expected seconds of a step of T tokens, as a function of T; None until two token counts were timed."""
        means = self._means[speculative]
        if len(means) < 2:
            return None
        points = sorted(means.items())
        xs = [x for x, _ in points]
        slope = _slope(points)

        def estimate(num_tokens: int) -> float:
            i = bisect.bisect_left(xs, num_tokens)
            if i < len(xs) and xs[i] == num_tokens:
                return points[i][1]
            if 0 < i < len(xs):
                (x0, y0), (x1, y1) = points[i - 1], points[i]
                return y0 + (y1 - y0) * (num_tokens - x0) / (x1 - x0)
            x, y = points[-1] if i else points[0]
            return max(0.0, y + slope * (num_tokens - x))

        return estimate


def _slope(points: list[tuple[int, float]]) -> float:
    mx = sum(x for x, _ in points) / len(points)
    my = sum(y for _, y in points) / len(points)
    return max(0.0, sum((x - mx) * (y - my) for x, y in points) / sum((x - mx) ** 2 for x, _ in points))


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
        gains = sorted(((self.acceptance.rate_of(rid) ** j, rid) for rid, p in proposals.items() for j in range(1, len(p) + 1)),
                       reverse=True)
        plain, spec = self.cost.curve(speculative=False), self.cost.curve(speculative=True)
        if not self.adaptive or plain is None or spec is None:
            return {rid: len(p) for rid, p in proposals.items() if p}  # (also: measure what it costs)
        best_m, best, gain = 0, num_outputs / max(plain(base_tokens), 1e-9), 0.0
        for m, (g, _) in enumerate(gains, 1):
            gain += g
            rate = (num_outputs + gain) / max(spec(base_tokens + m), 1e-9)
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

"""The on/off switch: speculate only while the measured cost model says it pays.

`StepCostModel` times the engine's steps: plain steps give the mean step time per token count
(interpolated between counts), verifying steps the overhead a verifying sequence adds beyond its
tokens. `AcceptanceTracker` measures acceptance per proposal kind (engine.speculative.proposer): how
often a proposal's first token is kept, and how often a token is kept once the one before it was
(kinds without history start at the rates over all kinds). Each step, `SpeculationSwitch.choose`
ranks every candidate proposed token by its probability of being kept (first * next^(j-1) for the
j-th token of a proposal) and keeps the best-ranked m that maximise expected tokens per second:
(outputs + kept gain) / (t(T0 + m) + overhead * sequences verifying) against outputs / t(T0). At low
load a verified token costs little and all but hopeless ones pay; at a large batch or token budget none
does. Until plain steps have been timed it does not speculate; until the overhead is known, and every
`PROBE_EVERY` steps it kept nothing, it verifies one sequence's proposal (to measure the overhead and
refresh the acceptance rates it relies on; cheap at any load).
"""

from __future__ import annotations

import bisect
import statistics
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass

from engine.speculative.proposer import Proposal

PROBE_EVERY = 16
OVERHEAD_SAMPLES = 15
EMA = 0.2
"""Weight of the newest measurement in a moving average."""
PRIOR_WEIGHT = 4.0
"""A kind's acceptance counts as this many trials at the rate over all kinds before its own."""
HISTORY = 256
"""Trials a rate remembers (older ones fade)."""
MAX_POINTS = 64


class StepCostModel:
    """Plain steps: mean step time per token count, interpolated between counts (extrapolated with the
    least-squares slope). Verifying steps cost that plus an overhead per verifying sequence, measured
    (on a CPU the first extra token of a step leaves the matrix-vector kernels, and each verifying
    sequence is a multi-query row of the decode kernel)."""

    def __init__(self):
        self._means: OrderedDict[int, float] = OrderedDict()
        self._overheads: deque[float] = deque(maxlen=OVERHEAD_SAMPLES)

    @property
    def overhead(self) -> float | None:
        """Seconds a verifying sequence adds to a step beyond its tokens (the median of recent
        measurements: one step slowed by a neighbour must not turn speculation off); None until measured."""
        return statistics.median(self._overheads) if self._overheads else None

    def record(self, num_tokens: int, num_verifying: int, seconds: float) -> None:
        if num_verifying:
            plain = self.curve()
            if plain is not None:
                self._overheads.append((seconds - plain(num_tokens)) / num_verifying)
            return
        old = self._means.pop(num_tokens, None)
        self._means[num_tokens] = seconds if old is None else old + EMA * (seconds - old)
        if len(self._means) > MAX_POINTS:
            self._means.popitem(last=False)

    def curve(self) -> Callable[[int], float] | None:
        """Expected seconds of a plain step of T tokens, as a function of T; None until two token counts were timed."""
        if len(self._means) < 2:
            return None
        points = sorted(self._means.items())
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
    kept: float = 0.0
    tried: float = 0.0

    def add(self, kept: int, tried: int) -> None:
        self.kept += kept
        self.tried += tried
        if self.tried > HISTORY:  # older trials fade: a kind's rate follows the traffic
            self.kept *= HISTORY / self.tried
            self.tried = HISTORY

    def estimate(self, prior: float) -> float:
        return (self.kept + PRIOR_WEIGHT * prior) / (self.tried + PRIOR_WEIGHT)


class AcceptanceTracker:
    """Per proposal kind, two measured rates: the first proposed token kept, and a token kept once the
    one before it was (a proposal's tokens are kept as a prefix). A kind's estimates start at the rates
    over all kinds, which start at `initial`."""

    def __init__(self, initial: float = 0.5):
        self._all = (_Rate(), _Rate())
        self._initial = initial
        self._kinds: dict[str, tuple[_Rate, _Rate]] = {}

    def record(self, kind: str, proposed: int, accepted: int) -> None:
        if not proposed:
            return
        first_kept = min(accepted, 1)
        next_tried = min(accepted, proposed - 1)  # tokens 2.. that were reached
        for first, following in (self._all, self._kinds.setdefault(kind, (_Rate(), _Rate()))):
            first.add(first_kept, 1)
            following.add(accepted - first_kept, next_tried)

    def rates(self, kind: str) -> tuple[float, float]:
        """(first token kept, next token kept after a kept one) for proposals of `kind`."""
        first_all, next_all = (rate.estimate(self._initial) for rate in self._all)
        first, following = self._kinds.get(kind, (_Rate(), _Rate()))
        return first.estimate(first_all), following.estimate(next_all)

    def gains(self, kind: str, length: int) -> list[float]:
        """The probability that each of the first `length` tokens of a proposal of `kind` is kept."""
        first, following = self.rates(kind)
        return [first * following ** j for j in range(length)]


class SpeculationSwitch:
    def __init__(self, adaptive: bool):
        self.adaptive = adaptive
        self.cost = StepCostModel()
        self.acceptance = AcceptanceTracker()
        self._idle_steps = 0

    def choose(self, base_tokens: int, num_outputs: int, proposals: dict[str, Proposal]) -> dict[str, int]:
        """How many of each sequence's proposed tokens to verify this step (sequences left out: none).
        base_tokens: the step's tokens without proposals; num_outputs: sequences sampling in it."""
        if not self.adaptive:
            return {rid: len(p.tokens) for rid, p in proposals.items() if p.tokens}
        gains = sorted(((gain, rid) for rid, p in proposals.items() for gain in self.acceptance.gains(p.kind, len(p.tokens))),
                       reverse=True)
        plain = self.cost.curve()
        if plain is None:
            return {}  # time plain steps first
        if self.cost.overhead is None:
            return self._probe(gains, proposals)  # measure with one sequence: cheap at any load
        best_m, best, gain, seqs = 0, num_outputs / max(plain(base_tokens), 1e-9), 0.0, set()
        for m, (g, rid) in enumerate(gains, 1):
            gain += g
            seqs.add(rid)
            rate = (num_outputs + gain) / max(plain(base_tokens + m) + self.cost.overhead * len(seqs), 1e-9)
            if rate > best:
                best_m, best = m, rate
        if best_m == 0 and gains:
            self._idle_steps += 1
            if self._idle_steps >= PROBE_EVERY:
                return self._probe(gains, proposals)
            return {}
        self._idle_steps = 0
        chosen: dict[str, int] = {}
        for _, rid in gains[:best_m]:
            chosen[rid] = chosen.get(rid, 0) + 1
        return chosen

    def _probe(self, gains: list[tuple[float, str]], proposals: dict[str, Proposal]) -> dict[str, int]:
        self._idle_steps = 0
        rid = gains[0][1] if gains else None
        return {rid: len(proposals[rid].tokens)} if rid is not None else {}

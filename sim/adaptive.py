"""The adaptive P/D controller as simulator events: a decision every `interval_s`, carried out at once.

A simplified reading of deploy/adaptive.py's two lanes (not imported: deploy sits above sim), from
signals over the last `window_s` of simulated time:
  prefill pressed  TTFT p90 of the requests finished in the window over `ttft_slo_ms`,
                   or queued prompt tokens per prefill worker over `queued_tokens_per_worker`
  decode pressed   TPOT p90 of the requests finished in the window over `itl_slo_ms`, or KV usage over 0.9
  threshold lane   prefill pressed and decode not: the local-prefill threshold rises by `step` (to `max`),
                   decode pressed: it falls by `step` (to 0)
  split lane       prefill pressed with the threshold at its max and decode not pressed: a decode worker
                   (the least loaded, if the pool keeps `min_decode`) drains and becomes a prefill worker;
                   decode pressed and prefill not: a prefill worker (keeping `min_prefill`) becomes decode
Each lane acts only after `hold` consecutive decisions agree and `cooldown_s` after its last action; a
switching worker takes no new requests and changes role once it holds none. Every decision that acts is
logged in `decisions` with its signals.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np

from sim.core import SharedLink
from sim.workload import SimRequest


@dataclass(frozen=True)
class AdaptiveSettings:
    interval_s: float = 2.0
    window_s: float = 6.0
    ttft_slo_ms: float = 6000.0
    itl_slo_ms: float = 250.0
    queued_tokens_per_worker: int = 4096
    step: int = 512
    max: int = 1024
    hold: int = 2
    cooldown_s: float = 20.0
    min_prefill: int = 0
    min_decode: int = 1


class Controller:
    def __init__(self, cluster, settings: AdaptiveSettings, requests: list[SimRequest]) -> None:
        self.cluster, self.loop = cluster, cluster.loop
        self.s = settings
        self.decisions: list[dict] = []
        self._done: deque[SimRequest] = deque()
        """Requests finished within the last window."""
        self._votes: dict[str, tuple[str | None, int]] = {"threshold": (None, 0), "split": (None, 0)}
        self._last: dict[str, float] = {"threshold": -1e18, "split": -1e18}
        self._end = max((r.arrival for r in requests), default=0.0)
        self._switching: list = []
        self.loop.at(self.s.interval_s, self.tick)

    def finished(self, req: SimRequest) -> None:
        self._done.append(req)
        self._complete_switches()

    def tick(self) -> None:
        now, c = self.loop.now, self.cluster
        while self._done and self._done[0].finish < now - self.s.window_s:
            self._done.popleft()
        ttft = [r.ttft for r in self._done]
        tpot = [r.tpot for r in self._done if r.tpot is not None]
        queued = sum(j.todo or j.tokens for w in c.prefills for j in w.waiting) / max(1, len(c.prefills))
        usage = max((1 - w.pool.free_fraction for w in c.decodes), default=0.0)
        signals = {"ttft_p90_ms": _p90(ttft), "tpot_p90_ms": _p90(tpot), "queued_tokens_per_prefill": queued, "decode_kv_usage": usage,
                   "threshold": c.threshold, "shape": f"{len(c.prefills)}P/{len(c.decodes)}D"}
        prefill_hot = (signals["ttft_p90_ms"] or 0) > self.s.ttft_slo_ms or (c.prefills and queued > self.s.queued_tokens_per_worker)
        decode_hot = (signals["tpot_p90_ms"] or 0) > self.s.itl_slo_ms or usage > 0.9
        want_t = "up" if prefill_hot and not decode_hot and c.threshold < self.s.max else "down" if decode_hot and c.threshold > 0 else None
        if self._ready("threshold", want_t, now):
            c.threshold = min(self.s.max, c.threshold + self.s.step) if want_t == "up" else max(0, c.threshold - self.s.step)
            self._log(now, "threshold", want_t, signals)
        want_s = None
        if prefill_hot and not decode_hot and c.threshold >= self.s.max and len(c.decodes) - 1 >= self.s.min_decode:
            want_s = "to_prefill"
        elif decode_hot and not prefill_hot and len(c.prefills) - 1 >= self.s.min_prefill:
            want_s = "to_decode"
        if not self._switching and self._ready("split", want_s, now):
            self._switch(want_s)
            self._log(now, "split", want_s, signals)
        if now < self._end or any(w.running or w.waiting for w in c.prefills + c.decodes):
            self.loop.at(now + self.s.interval_s, self.tick)

    def _ready(self, lane: str, want: str | None, now: float) -> bool:
        last, count = self._votes[lane]
        count = count + 1 if want is not None and want == last else (1 if want else 0)
        self._votes[lane] = (want, count)
        if want is None or count < self.s.hold or now - self._last[lane] < self.s.cooldown_s:
            return False
        self._last[lane] = now
        self._votes[lane] = (None, 0)
        return True

    def _switch(self, direction: str) -> None:
        c = self.cluster
        pool = c.decodes if direction == "to_prefill" else c.prefills
        worker = min(pool, key=lambda w: (w.load, w.index))
        pool.remove(worker)  # the router no longer sees it
        self._switching.append((worker, "prefill" if direction == "to_prefill" else "decode"))
        self._complete_switches()

    def _complete_switches(self) -> None:
        c = self.cluster
        for worker, role in list(self._switching):
            if worker.running or worker.waiting or worker.admission or worker.incoming or worker.step is not None or worker.in_flight:
                continue
            self._switching.remove((worker, role))
            worker.role = role
            (c.prefills if role == "prefill" else c.decodes).append(worker)
            if role == "prefill" and worker.index not in c.links:
                link = c.profile.link(c.spec.transport)
                c.links[worker.index] = SharedLink(self.loop, link.bytes_per_s * worker.tp, link.latency_s)

    def _log(self, now: float, lane: str, action: str, signals: dict) -> None:
        self.decisions.append({"t_s": round(now, 3), "lane": lane, "action": action, "signals": signals,
                               "after": {"threshold": self.cluster.threshold,
                                         "shape": f"{len(self.cluster.prefills)}P/{len(self.cluster.decodes)}D (+{len(self._switching)} switching)"}})


def _p90(values: list[float]) -> float | None:
    return float(np.percentile(np.asarray(values) * 1000, 90)) if values else None

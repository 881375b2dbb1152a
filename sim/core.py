"""The simulator's clock and the resources workers share.

Lifecycle: a `Loop` owns simulated time; everything happens in callbacks it runs in time order
(`at(t, fn, *args)`; equal times run in the order they were scheduled, so a run is deterministic).
A `Host` is a machine whose CPU cores its workers share (a step slows by busy workers / cores when
more workers than cores are busy, times the profile's measured excess of two engines sharing a core over
2x; and by the profile's measured other-core ratio while an engine runs on another core: memory
bandwidth and caches are shared too; a GPU worker has its own device: no host); workers pinned one core
each get a `Host(1)` per core, shared only by the workers pinned there, whose `peers` are the other cores. A `SharedLink` is one
KV link whose concurrent transfers share its rate equally (processor sharing); a transfer also has a
time before which it cannot end (the last layer's bytes leave after the prefill step that made them).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


class Loop:
    def __init__(self) -> None:
        self.now = 0.0
        self._queue: list[tuple[float, int, Callable, tuple]] = []
        self._order = itertools.count()
        self.events = 0

    def at(self, t: float, fn: Callable, *args: Any) -> None:
        heapq.heappush(self._queue, (max(t, self.now), next(self._order), fn, args))

    def run(self) -> None:
        queue, pop = self._queue, heapq.heappop
        while queue:
            t, _, fn, args = pop(queue)
            self.now = t
            self.events += 1
            fn(*args)


@dataclass(frozen=True)
class Sharing:
    """What sharing a CPU costs one kind of step, as `pdserve profile` measures it (sim/profile.py `Profile`):
    `same_core`, its time with a second engine on its core over its time alone (2.0: fair sharing, nothing lost);
    `other_core`, its time while an engine runs on another core (1.0: no effect)."""

    same_core: float = 2.0
    other_core: float = 1.0


class Host:
    """CPU cores shared by the workers placed on it; `factor(decoding)` is how much slower a step runs now.

    A prefill (or mixed) step pays `prefill`'s ratios, a decode-only step `decode`'s (by default the same): the two
    are measured apart, since a decode step reads the whole model and its KV for a few tokens each and a neighbour's
    traffic on memory and caches may cost it differently (on the Zen 4 it did not: bf16 2.20 / 1.00 vs 2.13 / 1.00)."""

    def __init__(self, cores: float, prefill: Sharing = Sharing(), decode: Sharing | None = None) -> None:
        self.cores = cores
        self.sharing = {False: prefill, True: decode or prefill}
        self.busy: set[int] = set()
        self.workers: list = []
        self.peers: list[Host] = []
        """The machine's other cores, when workers are pinned one core each."""

    def factor(self, decoding: bool = False) -> float:
        ratios = self.sharing[decoding]
        busy = len(self.busy)
        factor = 1.0
        if busy > self.cores:
            factor = busy / self.cores * ratios.same_core / 2
        if (busy >= 2 and self.cores >= 2) or any(peer.busy for peer in self.peers):
            factor *= ratios.other_core
        return factor

    def set_busy(self, worker, busy: bool) -> None:
        before = len(self.busy)
        (self.busy.add if busy else self.busy.discard)(worker.index)
        if len(self.busy) == before:
            return
        for other in self.workers:
            if other is not worker:
                other.host_changed()
        if not before or not self.busy:  # this core went busy or idle: its peers' speed changed
            for peer in self.peers:
                for other in peer.workers:
                    other.host_changed()


class SharedLink:
    """Processor sharing over `bytes_per_s`; `send(nbytes, not_before, done)` calls done() when the bytes are
    through, no earlier than `not_before`, plus the link's latency."""

    def __init__(self, loop: Loop, bytes_per_s: float, latency_s: float) -> None:
        self.loop, self.rate, self.latency = loop, bytes_per_s, latency_s
        self._active: dict[int, list] = {}  # id -> [remaining bytes, not_before, done]
        self._ids = itertools.count()
        self._last = 0.0
        self._version = 0
        self.bytes_moved = 0.0

    def send(self, nbytes: float, not_before: float, done: Callable[[], None]) -> None:
        self._advance()
        self.bytes_moved += nbytes
        self._active[next(self._ids)] = [max(nbytes, 0.0), not_before, done]
        self._reschedule()

    def share(self) -> float:
        """The rate one more transfer would get now."""
        return self.rate / (len(self._active) + 1)

    def _advance(self) -> None:
        now = self.loop.now
        if self._active:
            each = (now - self._last) * self.rate / len(self._active)
            for job in self._active.values():
                job[0] -= each
        self._last = now

    def _reschedule(self) -> None:
        self._version += 1
        if self._active:
            least = min(job[0] for job in self._active.values())
            self.loop.at(self.loop.now + max(least, 0.0) * len(self._active) / self.rate, self._complete, self._version)

    def _complete(self, version: int) -> None:
        if version != self._version:
            return
        self._advance()
        least = min(job[0] for job in self._active.values())
        slack = max(least, 0.0) + self.rate * 1e-9  # float error: the least one is done now, and any within a nanosecond
        for key in [k for k, job in self._active.items() if job[0] <= slack]:
            _, not_before, done = self._active.pop(key)
            self.loop.at(max(self.loop.now + self.latency, not_before), done)
        self._reschedule()

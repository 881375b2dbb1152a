"""Test hooks that break things on purpose, to prove pdserve detects every failure and loses nothing.

Two kinds of hook live here, both off unless configured. Both are built once, when a process
starts (the worker's main reads the config and the environment; a test harness builds its own),
and handed to the constructors of the objects that call them: no hot path reads the environment.

* `FaultInjector` damages KV transfers. A `KVSender` is given one (built from the config field
  `kv_transfer.faults`, else from the environment variable `PDSERVE_KV_FAULTS` of a worker
  process started by a test). For every layer it is about to put on the wire the sender asks
  `plan(transfer_id, layer)` what to do:

      delay     sleep before sending the layer (the transfer still succeeds, later)
      drop      never send this layer, the later ones or the trailer (the receiver times out)
      truncate  send the layer's K and V cut to half their size (the receiver: shape error)
      corrupt   flip one byte of the layer's K (the receiver: checksum error)
      cut       close the connection before sending the layer (the receiver: connection error)
      forge     zero the K and V of this layer and every later one *before* the checksum is taken:
                wrong KV that every check of the wire accepts (only the router's canary,
                router/shadow.py, can tell)

  Except for forge, the checksum a sender announces is always the one of the untouched bytes, so
  the receiver sees exactly what an in-flight fault would do.

* `FaultPoint` stalls (or just marks) a worker process at a named point of a request's life, so
  a test can SIGKILL / SIGSTOP it exactly there. Points: `prefill.before_transfer`,
  `prefill.after_layer` (N = layer), `prefill.after_transfer`, `decode.before_transfer`,
  `decode.after_transfer`, `decode.after_tokens` (N = tokens streamed), `source.before_send` (a worker
  about to send a prefix another worker pulls: kvtransfer/prefix.py). When a request reaches
  its point the process logs `test hook: <action> at <point> ...` and, for `stall`, blocks the
  calling thread for an hour. It fires once per process.

Spec syntax (comma-separated entries; a pattern is an exact id or an fnmatch glob such as
`tamper-*` or `*.0-*`):

    PDSERVE_KV_FAULTS=<kind>:<transfer id pattern>:<layer>      delay: ...:<layer>:<milliseconds>
    PDSERVE_TEST_FAULT_POINT=<point>:<N>:<request id pattern>[:stall|mark]   (N is 0 where unused)

Transfer ids are `<decode request id>-<suffix>` and the router's decode request ids are
`<client request id>.<attempt>`, so `corrupt:bad-*.0-*:7` damages only a request's first attempt.
"""

from __future__ import annotations

import fnmatch
import logging
import os
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from common.faultspec import ENV_VAR, Fault, FaultKind, parse_faults

log = logging.getLogger(__name__)

POINT_ENV_VAR = "PDSERVE_TEST_FAULT_POINT"
LEGACY_PAUSE_ENV_VAR = "PDSERVE_TEST_PAUSE_AFTER_LAYER"  # = prefill.after_layer:<N>:*:stall


@dataclass(frozen=True)
class LayerPlan:
    """What the sender does to one layer (all false: send it untouched)."""

    delay_s: float = 0.0
    drop: bool = False
    truncate: bool = False
    corrupt: bool = False
    cut: bool = False


CLEAN = LayerPlan()


@dataclass
class FaultInjector:
    """The faults of one sender. `corrupt` ({pattern: layer}) is shorthand for corrupt faults."""

    faults: list[Fault] = field(default_factory=list)
    corrupt: Mapping[str, int] = field(default_factory=dict)
    fired: list[tuple[str, str, int]] = field(default_factory=list)
    """(kind, transfer id, layer) of every fault applied, in order."""
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def __post_init__(self) -> None:
        self.faults = [*self.faults, *(Fault(FaultKind.CORRUPT, p, layer) for p, layer in self.corrupt.items())]
        self.corrupt = {f.pattern: f.layer for f in self.faults if f.kind == FaultKind.CORRUPT}

    @classmethod
    def parse(cls, spec: str) -> FaultInjector | None:
        """The injector a spec describes, or None for an empty spec; ValueError if malformed."""
        entries = [e for e in spec.split(",") if e.strip()]
        if not entries:
            return None
        injector = cls(faults=parse_faults(spec))
        log.warning("KV fault injection enabled: %s", ", ".join(e.strip() for e in entries))
        return injector

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> FaultInjector | None:
        return cls.parse(environ.get(ENV_VAR, ""))

    @classmethod
    def configured(cls, spec: str = "", environ: Mapping[str, str] = os.environ) -> FaultInjector | None:
        """From the config field when it is set, else from the environment (test processes)."""
        return cls.parse(spec) if spec.strip() else cls.from_env(environ)

    @property
    def tampered(self) -> list[tuple[str, int]]:
        """(transfer id, layer) of every corrupted layer."""
        return [(tid, layer) for kind, tid, layer in self.fired if kind == FaultKind.CORRUPT]

    def _matching(self, transfer_id: str) -> list[Fault]:
        """Faults for this transfer: those naming its exact id win over glob matches."""
        exact = [f for f in self.faults if f.pattern == transfer_id]
        return exact or [f for f in self.faults if fnmatch.fnmatchcase(transfer_id, f.pattern)]

    def plan(self, transfer_id: str, layer: int) -> LayerPlan:
        """What to do to `layer` of `transfer_id`; records each fault that fires."""
        hits = [f for f in self._matching(transfer_id) if f.hits(layer) and f.kind != FaultKind.FORGE]  # see `forge`
        if not hits:
            return CLEAN
        kinds = {f.kind for f in hits}
        plan = LayerPlan(
            delay_s=sum(f.delay_ms for f in hits if f.kind == FaultKind.DELAY) / 1000,
            drop=FaultKind.DROP in kinds,
            truncate=FaultKind.TRUNCATE in kinds,
            corrupt=FaultKind.CORRUPT in kinds,
            cut=FaultKind.CUT in kinds,
        )
        with self._lock:
            self.fired.extend((kind.value, transfer_id, layer) for kind in sorted(kinds))
        log.warning("fault injection: %s on transfer %s layer %d", "+".join(sorted(kinds)), transfer_id, layer)
        return plan

    def forge(self, transfer_id: str, layer: int, parts: list[np.ndarray]) -> list[np.ndarray]:
        """The layer's parts as the sender checksums them: zeroed when a forge fault hits it."""
        hits = [f for f in self._matching(transfer_id) if f.kind == FaultKind.FORGE and f.hits(layer)]
        if not hits:
            return parts
        with self._lock:
            self.fired.append((FaultKind.FORGE.value, transfer_id, layer))
        return [np.zeros_like(p) for p in parts]

    @staticmethod
    def damage(plan: LayerPlan, parts: Sequence[np.ndarray]) -> list[np.ndarray]:
        """The parts to put on the wire: halved if truncated, one byte flipped if corrupted."""
        wire = [p[: len(p) // 2] for p in parts] if plan.truncate else list(parts)
        if plan.corrupt and wire and len(wire[0]):
            damaged = wire[0].copy()
            damaged[len(damaged) // 2] ^= 0xFF
            wire[0] = damaged
        return wire

    def tamper(self, transfer_id: str, layer: int, parts: Sequence[np.ndarray]) -> list[np.ndarray]:
        """`damage(plan(...))` in one call (corrupt and truncate only)."""
        return self.damage(self.plan(transfer_id, layer), parts)


@dataclass
class FaultPoint:
    """Stall or mark a worker process when a request matching `pattern` reaches `point`."""

    point: str
    count: int = 0
    pattern: str = "*"
    stall: bool = True
    fired: bool = False
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    POINTS = (
        "prefill.before_transfer",
        "prefill.after_layer",
        "prefill.after_transfer",
        "decode.before_transfer",
        "decode.after_transfer",
        "decode.after_tokens",
        "source.before_send",
    )

    @classmethod
    def parse(cls, spec: str) -> FaultPoint:
        point, count, pattern, action = ([*spec.strip().split(":", 3), "", "", ""])[:4]
        if point not in cls.POINTS or not (count or "0").isdigit() or action not in ("", "stall", "mark"):
            raise ValueError(f"bad {POINT_ENV_VAR} {spec!r}; expected <point>:<N>:<request id pattern>[:stall|mark], "
                             f"point one of {', '.join(cls.POINTS)}")
        return cls(point, int(count or 0), pattern or "*", action != "mark")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> FaultPoint | None:
        if environ.get(POINT_ENV_VAR, "").strip():
            return cls.parse(environ[POINT_ENV_VAR])
        legacy = environ.get(LEGACY_PAUSE_ENV_VAR, "").strip()
        if legacy and legacy.lstrip("-").isdigit() and int(legacy) >= 0:
            return cls("prefill.after_layer", int(legacy))
        return None

    def reached(self, point: str, request_id: str, count: int = 0) -> None:
        """Call at `point`; fires (logs, then stalls unless marking) the first time it matches."""
        if point != self.point or count < self.count or not fnmatch.fnmatchcase(request_id, self.pattern):
            return
        with self._lock:
            if self.fired:
                return
            self.fired = True
        action = "pausing" if self.stall else "marking"
        log.warning("test hook: %s at %s %d (request %s, pid %d)", action, point, count, request_id, os.getpid())
        if self.stall:
            time.sleep(3600)  # the test kills (or stops) this process now


def reached(hook: FaultPoint | None, point: str, request_id: str, count: int = 0) -> None:
    """`hook.reached(...)` when a hook is configured; a no-op otherwise."""
    if hook is not None:
        hook.reached(point, request_id, count)

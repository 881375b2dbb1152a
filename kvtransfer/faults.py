"""Test hooks that damage a transfer on purpose, to prove receivers reject bad KV.

Lifecycle: a `FaultInjector` is given to a `KVSender` (or built from the environment variable
`PDSERVE_KV_FAULTS` in a worker process started by a test). The sender asks it, per layer,
whether to tamper with the bytes it is about to put on the wire; the checksum it announces is
always the one of the untouched bytes, so the receiver sees exactly an in-flight corruption.
Never enabled unless configured.

`PDSERVE_KV_FAULTS` syntax: comma-separated `corrupt:<transfer id pattern>:<layer>` entries; a
pattern is an exact transfer id or an fnmatch glob (`tamper-*`, `*`).
"""

from __future__ import annotations

import fnmatch
import logging
import os
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

log = logging.getLogger(__name__)

ENV_VAR = "PDSERVE_KV_FAULTS"


@dataclass
class FaultInjector:
    """Flips one byte of layer N's K payload of transfers whose id matches a glob pattern."""

    corrupt: Mapping[str, int] = field(default_factory=dict)
    tampered: list[tuple[str, int]] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> FaultInjector | None:
        spec = environ.get(ENV_VAR, "").strip()
        if not spec:
            return None
        corrupt: dict[str, int] = {}
        for entry in spec.split(","):
            kind, _, rest = entry.strip().partition(":")
            transfer_id, _, layer = rest.rpartition(":")
            if kind != "corrupt" or not transfer_id or not layer.isdigit():
                raise ValueError(f"bad {ENV_VAR} entry {entry!r}; expected corrupt:<transfer id pattern>:<layer>")
            corrupt[transfer_id] = int(layer)
        log.warning("KV fault injection enabled: %s", corrupt)
        return cls(corrupt=corrupt)

    def _target(self, transfer_id: str) -> int | None:
        """Layer to damage for this transfer: an exact id wins, else the first matching glob."""
        if transfer_id in self.corrupt:
            return self.corrupt[transfer_id]
        for pattern, layer in self.corrupt.items():
            if fnmatch.fnmatchcase(transfer_id, pattern):
                return layer
        return None

    def tamper(self, transfer_id: str, layer: int, parts: Sequence[np.ndarray]) -> list[np.ndarray]:
        """The parts to put on the wire: copies with one flipped byte if this layer is targeted."""
        target = self._target(transfer_id)
        if target != layer or not parts or not len(parts[0]):
            return list(parts)
        damaged = parts[0].copy()
        damaged[len(damaged) // 2] ^= 0xFF
        with self._lock:
            self.tampered.append((transfer_id, layer))
        log.warning("fault injection: flipped a byte of transfer %s layer %d", transfer_id, layer)
        return [damaged, *parts[1:]]

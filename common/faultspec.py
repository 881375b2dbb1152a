"""The grammar of KV fault specs (`kv_transfer.faults`, PDSERVE_KV_FAULTS): parsed here, below
the config, so that loading a config validates the spec without loading kvtransfer (torch).

kvtransfer/faults.py builds its `FaultInjector` from these `Fault`s and applies them.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

ENV_VAR = "PDSERVE_KV_FAULTS"


class FaultKind(StrEnum):
    DELAY = "delay"
    DROP = "drop"
    TRUNCATE = "truncate"
    CORRUPT = "corrupt"
    CUT = "cut"
    FORGE = "forge"


@dataclass(frozen=True)
class Fault:
    """One configured fault: `kind` hits layer `layer` of transfers whose id matches `pattern`."""

    kind: FaultKind
    pattern: str
    layer: int
    delay_ms: int = 0

    @classmethod
    def parse(cls, entry: str) -> Fault:
        kind, _, rest = entry.strip().partition(":")
        try:
            fault_kind = FaultKind(kind)
        except ValueError:
            raise ValueError(f"bad {ENV_VAR} entry {entry!r}: kind must be one of {', '.join(FaultKind)}") from None
        delay = ""
        if fault_kind == FaultKind.DELAY:
            rest, _, delay = rest.rpartition(":")
        pattern, _, layer = rest.rpartition(":")
        if not pattern or not layer.isdigit() or (fault_kind == FaultKind.DELAY and not delay.isdigit()):
            usage = "delay:<pattern>:<layer>:<ms>" if fault_kind == FaultKind.DELAY else f"{kind}:<pattern>:<layer>"
            raise ValueError(f"bad {ENV_VAR} entry {entry!r}; expected {usage}")
        return cls(fault_kind, pattern, int(layer), int(delay or 0))

    def hits(self, layer: int) -> bool:
        """A drop or a forge hits its layer and every later one; the other kinds hit exactly one layer."""
        return layer >= self.layer if self.kind in (FaultKind.DROP, FaultKind.FORGE) else layer == self.layer


def parse_faults(spec: str) -> list[Fault]:
    """The faults of a comma-separated spec (empty: none); ValueError names a malformed entry."""
    return [Fault.parse(e) for e in spec.split(",") if e.strip()]

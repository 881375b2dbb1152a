"""The configurations a trace replay compares, as data: a name -> routing policy + config overrides.

Every setup runs on a cluster of the same shape and base config; only its own keys differ. A setup runs
only when every part it names exists: its policy is registered (common/plugins.py ROUTING_POLICIES) and the
config loader accepts its whole config (common.config.config_from_dict: an unknown field is refused). A
setup that cannot run is listed in the results as "not available: <why>", never approximated by another.

The tier and pull keys below are issue #44 items 4 and 5 as they landed (engine.kv_tier, router.kv_pull); a
rename is one line here.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

TIER_MB = 1024
"""The second KV tier's budget per worker (MB of host memory) in the tier setups."""


@dataclass(frozen=True)
class Setup:
    name: str
    policy: str
    overrides: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Config sections merged over the base config: {"engine": {...}, "kv_transfer": {...}, ...}."""

    def config(self, base: dict[str, Any]) -> dict[str, Any]:
        """The base config with this setup's policy and overrides (nested mappings merged, the rest replaced)."""
        config = copy.deepcopy(base)
        _merge(config, {"router": {"policy": self.policy}})
        _merge(config, self.overrides)
        return config

    def unavailable(self, base: dict[str, Any]) -> str | None:
        """Why this setup cannot run with the code as it is, or None when it can."""
        from common.config import config_from_dict
        from common.plugins import ROUTING_POLICIES
        from common.validation import ConfigError

        reasons, config = [], self.config(base)
        if self.policy not in ROUTING_POLICIES:
            reasons.append(f"routing policy {self.policy!r} is not registered (common/plugins.py ROUTING_POLICIES: "
                           f"{', '.join(ROUTING_POLICIES)})")
            config["router"]["policy"] = "round_robin"  # so that the rest of its settings are checked too
        try:
            config_from_dict(config)
        except ConfigError as exc:
            reasons.append(f"the config loader refuses its settings: {exc}")
        return "; ".join(reasons) or None

    def describe(self) -> dict[str, Any]:
        return {"policy": self.policy, "overrides": self.overrides}


TIER = {"engine": {"kv_tier": {"kind": "memory", "budget_mb": TIER_MB}}}
PULL = {"router": {"kv_pull": True}}

SETUPS: tuple[Setup, ...] = (
    Setup("round_robin", "round_robin"),
    Setup("prefix_aware", "prefix_aware"),
    Setup("kv_aware", "kv_aware"),
    Setup("kv_aware+tier", "kv_aware", TIER),
    Setup("kv_aware+tier+pull", "kv_aware", {**TIER, **PULL}),
)
BY_NAME = {s.name: s for s in SETUPS}


def _merge(into: dict[str, Any], overrides: dict[str, Any]) -> None:
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            _merge(into[key], value)
        else:
            into[key] = copy.deepcopy(value)

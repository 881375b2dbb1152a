"""Field validators shared by every config section: each raises a `ConfigError` naming the field.

The one place the config's rules for integers, numbers, mappings and files are written; the
sections (common/config.py, common/engine_config.py) call these from their `validate`.
"""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path
from typing import Any


class ConfigError(ValueError):
    """A configuration field is invalid; `field` is its dotted name."""

    def __init__(self, field: str, message: str):
        self.field = field
        super().__init__(f"{field}: {message}")


def is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def positive_int(name: str, value: Any, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if not _is_int(value) or value < 1:
        raise ConfigError(name, f"must be an integer >= 1, got {value!r}")


def non_negative_int(name: str, value: Any) -> None:
    if not _is_int(value) or value < 0:
        raise ConfigError(name, f"must be an integer >= 0, got {value!r}")


def positive_float(name: str, value: Any) -> None:
    if not is_number(value) or value <= 0:
        raise ConfigError(name, f"must be a number > 0, got {value!r}")


def one_of(name: str, value: Any, choices: Any) -> None:
    if value not in choices:
        raise ConfigError(name, f"must be one of {', '.join(map(str, choices))}, got {value!r}")


def reject_unknown(data: dict, cls: type, prefix: str) -> None:
    """`prefix` ends with the dot (or is empty at the top level)."""
    known = {f.name for f in fields(cls)}
    for key in data:
        if key not in known:
            raise ConfigError(f"{prefix}{key}", f"unknown field (known: {', '.join(sorted(known))})")


def custom_resources(name: str, value: Any) -> None:
    if not isinstance(value, dict):
        raise ConfigError(name, f"must be a mapping of Ray resource names to amounts, got {value!r}")
    for key, amount in value.items():
        if not isinstance(key, str) or not key or key in ("CPU", "GPU", "memory", "object_store_memory"):
            raise ConfigError(f"{name}.{key}", "must be a custom resource name (use num_cpus / num_gpus for CPU and GPU)")
        if not is_number(amount) or amount <= 0:
            raise ConfigError(f"{name}.{key}", f"must be a number > 0, got {amount!r}")


def pem_file(name: str, path: str) -> None:
    try:
        text = Path(path).read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(name, f"cannot read {path}: {exc}") from None
    if "-----BEGIN " not in text:
        raise ConfigError(name, f"{path} is not a PEM file")

"""pdserve configuration: one YAML file loaded once into typed, validated objects.

`load_config(path)` reads YAML, rejects unknown fields and bad values with a `ConfigError` whose
`field` is the dotted path (`pools.decode.replicas`), and returns a frozen `PdserveConfig`. Every
process (router, workers, launcher) receives the same object (or its dict form) and never
re-reads the file. Field reference: docs/configuration.md.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import yaml

from engine.config import ConfigError, EngineConfig

TRANSPORTS = ("ucx", "tcp", "local")
ROUTING_POLICIES = ("round_robin", "least_loaded", "prefix_aware")
PLACEMENT_STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")
DEFAULT_CONFIG = Path(__file__).parent / "configs" / "local.yaml"


@dataclass(frozen=True)
class KVTransferConfig:
    transport: str = "ucx"
    host: str = "127.0.0.1"
    """Interface the decode workers' KV receivers bind to."""
    layerwise: bool = True
    """Ship each layer's KV as soon as it is computed (overlaps transfer with the remaining layers)."""
    timeout_s: float = 30.0

    def validate(self, prefix: str) -> None:
        if self.transport not in TRANSPORTS:
            raise ConfigError(f"{prefix}.transport", f"must be one of {', '.join(TRANSPORTS)}, got {self.transport!r}")
        _positive_float(f"{prefix}.timeout_s", self.timeout_s)


@dataclass(frozen=True)
class RouterConfig:
    host: str = "127.0.0.1"
    grpc_port: int = 50051
    http_port: int = 8000
    policy: str = "round_robin"
    max_queued_requests: int = 256
    max_queued_tokens: int = 262144
    request_timeout_s: float = 300.0
    prefill_retries: int = 2
    max_migrations: int = 2
    local_prefill_threshold: int = 0
    """Prompts up to this many tokens (with no cached prefix) are prefilled on the decode worker; 0 disables."""
    heartbeat_timeout_s: float = 5.0

    def validate(self, prefix: str) -> None:
        for name in ("grpc_port", "http_port"):
            value = getattr(self, name)
            if not isinstance(value, int) or not 0 <= value <= 65535:
                raise ConfigError(f"{prefix}.{name}", f"must be a port number in [0, 65535] (0 = any free port), got {value!r}")
        if self.policy not in ROUTING_POLICIES:
            raise ConfigError(f"{prefix}.policy", f"must be one of {', '.join(ROUTING_POLICIES)}, got {self.policy!r}")
        for name in ("max_queued_requests", "max_queued_tokens"):
            _positive_int(f"{prefix}.{name}", getattr(self, name))
        for name in ("prefill_retries", "max_migrations", "local_prefill_threshold"):
            _non_negative_int(f"{prefix}.{name}", getattr(self, name))
        _positive_float(f"{prefix}.request_timeout_s", self.request_timeout_s)
        _positive_float(f"{prefix}.heartbeat_timeout_s", self.heartbeat_timeout_s)


@dataclass(frozen=True)
class PoolConfig:
    replicas: int = 1
    min_replicas: int = 1
    max_replicas: int = 1
    num_cpus: float = 1.0
    num_gpus: float = 0.0
    placement_strategy: str = "PACK"
    num_threads: int | None = None
    """torch threads per worker; defaults to its CPU share."""

    def validate(self, prefix: str) -> None:
        for name in ("replicas", "min_replicas", "max_replicas"):
            _non_negative_int(f"{prefix}.{name}", getattr(self, name))
        if self.min_replicas > self.max_replicas:
            raise ConfigError(f"{prefix}.min_replicas", f"({self.min_replicas}) must be <= max_replicas ({self.max_replicas})")
        if not self.min_replicas <= self.replicas <= self.max_replicas:
            raise ConfigError(f"{prefix}.replicas", f"({self.replicas}) must be within [min_replicas, max_replicas] = [{self.min_replicas}, {self.max_replicas}]")
        for name in ("num_cpus", "num_gpus"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or value < 0:
                raise ConfigError(f"{prefix}.{name}", f"must be a number >= 0, got {value!r}")
        if self.placement_strategy not in PLACEMENT_STRATEGIES:
            raise ConfigError(f"{prefix}.placement_strategy", f"must be one of {', '.join(PLACEMENT_STRATEGIES)}, got {self.placement_strategy!r}")
        if self.num_threads is not None:
            _positive_int(f"{prefix}.num_threads", self.num_threads)


@dataclass(frozen=True)
class PoolsConfig:
    prefill: PoolConfig = field(default_factory=PoolConfig)
    decode: PoolConfig = field(default_factory=PoolConfig)


@dataclass(frozen=True)
class PdserveConfig:
    model_name: str = "smollm2-135m"
    """Name the API serves the model under (OpenAI `model` field)."""
    engine: EngineConfig = field(default_factory=EngineConfig)
    kv_transfer: KVTransferConfig = field(default_factory=KVTransferConfig)
    router: RouterConfig = field(default_factory=RouterConfig)
    pools: PoolsConfig = field(default_factory=PoolsConfig)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def load_config(path: str | Path | None = None) -> PdserveConfig:
    path = Path(path) if path else DEFAULT_CONFIG
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except OSError as exc:
        raise ConfigError("config", f"cannot read {path}: {exc}") from None
    except yaml.YAMLError as exc:
        raise ConfigError("config", f"{path} is not valid YAML: {exc}") from None
    return config_from_dict(data)


def config_from_dict(data: dict[str, Any]) -> PdserveConfig:
    if not isinstance(data, dict):
        raise ConfigError("config", "the top level must be a mapping")
    _reject_unknown(data, PdserveConfig, "")
    engine = EngineConfig.from_dict(_section(data, "engine"), prefix="engine")
    kv = _build(KVTransferConfig, _section(data, "kv_transfer"), "kv_transfer")
    router = _build(RouterConfig, _section(data, "router"), "router")
    pools_data = _section(data, "pools")
    _reject_unknown(pools_data, PoolsConfig, "pools.")
    pools = PoolsConfig(
        prefill=_build(PoolConfig, _section(pools_data, "prefill", "pools."), "pools.prefill"),
        decode=_build(PoolConfig, _section(pools_data, "decode", "pools."), "pools.decode"),
    )
    model_name = data.get("model_name", engine.model)
    if not isinstance(model_name, str) or not model_name:
        raise ConfigError("model_name", "must be a non-empty string")
    return PdserveConfig(model_name=model_name, engine=engine, kv_transfer=kv, router=router, pools=pools)


def _section(data: dict, key: str, prefix: str = "") -> dict:
    value = data.get(key) or {}
    if not isinstance(value, dict):
        raise ConfigError(f"{prefix}{key}", "must be a mapping")
    return value


def _reject_unknown(data: dict, cls: type, prefix: str) -> None:
    known = {f.name for f in fields(cls)}
    for key in data:
        if key not in known:
            raise ConfigError(f"{prefix}{key}", f"unknown field (known: {', '.join(sorted(known))})")


def _build(cls: type, data: dict, prefix: str):
    _reject_unknown(data, cls, prefix + ".")
    try:
        obj = cls(**data)
    except TypeError as exc:
        raise ConfigError(prefix, str(exc)) from None
    obj.validate(prefix)
    return obj


def _positive_int(name: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(name, f"must be an integer >= 1, got {value!r}")


def _non_negative_int(name: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ConfigError(name, f"must be an integer >= 0, got {value!r}")


def _positive_float(name: str, value: Any) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
        raise ConfigError(name, f"must be a number > 0, got {value!r}")

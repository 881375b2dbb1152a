"""pdserve configuration: one YAML file loaded once into typed, validated objects.

`load_config(path)` reads YAML, rejects unknown fields and bad values with a `ConfigError` whose
`field` is the dotted path (`pools.decode.replicas`), and returns a frozen `PdserveConfig`. Every
process (router, workers, launcher) receives the same object (or its dict form) and never
re-reads the file. Field reference: docs/configuration.md.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from common.controller_config import AdaptiveConfig
from common.engine_config import EngineConfig
from common.faultspec import parse_faults
from common.plugins import KV_TRANSPORTS, ROUTING_POLICIES
from common.secrets import MIN_SECRET_CHARS, SECRET_ENV, secret_source
from common.validation import (
    ConfigError,
    custom_resources,
    is_number,
    non_negative_int,
    one_of,
    pem_file,
    positive_float,
    positive_int,
    reject_unknown,
)

WIRE_DTYPES = ("auto", "native", "int8", "fp8")  # kvtransfer/codec.py (not imported: config stays torch-free)
PLACEMENT_STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")
TRACE_EXPORTERS = ("console", "file", "otlp")
OTLP_MODULES = {
    "grpc": "opentelemetry.exporter.otlp.proto.grpc.trace_exporter",
    "http": "opentelemetry.exporter.otlp.proto.http.trace_exporter",
}
"""Where the optional OTLP span exporter of each protocol lives (`pdserve[otlp]`)."""
DEFAULT_CONFIG = Path(__file__).parent.parent / "deploy" / "configs" / "local.yaml"
"""Shipped with the `deploy` package (package data), where the docs and scripts point."""


@dataclass(frozen=True)
class KVTransferConfig:
    transport: str = "ucx"
    host: str = "127.0.0.1"
    """Interface the decode workers' KV receivers bind to."""
    layerwise: bool | None = None
    """Ship each layer's KV as soon as it is computed (overlaps transfer with the remaining layers), or (false) all
    layers once the prompt is done. None: layer by layer where the engine runs on a GPU, whose forward leaves the
    host's cores free to send; after the prompt on a CPU, where the same core computes and sends: there, a
    one-thread prefill worker's first token came 25-34 ms sooner without it (a quiet 1P+1D, prompts of 64-256
    tokens, bf16, Zen 4: `streams_layerwise`)."""
    timeout_s: float = 30.0
    faults: str = ""
    """Test hook, off by default: KV faults prefill workers inject (kvtransfer/faults.py syntax)."""
    wire_dtype: str = "native"
    """KV on the wire: native (lossless), int8 or fp8 (lossy, per token-and-head scales, decoded into the
    receiver's dtype), or auto: int8 to a decode worker whose measured link rate is below compress_below_gbps."""
    compress_below_gbps: float = 2.0
    """With wire_dtype auto: compress KV to decode workers whose link rate measured from earlier transfers is below this."""

    def streams_layerwise(self, device: str) -> bool:
        """Whether a prefill engine on `device` hands its prompts' KV over layer by layer (`layerwise`)."""
        return self.layerwise if self.layerwise is not None else device.startswith("cuda")

    def validate(self, prefix: str) -> None:
        if self.layerwise is not None and not isinstance(self.layerwise, bool):
            raise ConfigError(f"{prefix}.layerwise", f"must be true, false or absent (by device), got {self.layerwise!r}")
        one_of(f"{prefix}.transport", self.transport, KV_TRANSPORTS)
        one_of(f"{prefix}.wire_dtype", self.wire_dtype, WIRE_DTYPES)
        positive_float(f"{prefix}.compress_below_gbps", self.compress_below_gbps)
        positive_float(f"{prefix}.timeout_s", self.timeout_s)
        try:
            parse_faults(self.faults)
        except (ValueError, AttributeError) as exc:
            raise ConfigError(f"{prefix}.faults", str(exc)) from None


@dataclass(frozen=True)
class RouterConfig:
    host: str = "127.0.0.1"
    grpc_port: int = 50051
    http_port: int = 8000
    internal_host: str = ""
    """Address of the router's internal gRPC port (the workers' `Registry`); empty: `host`
    (under Ray: the router's node address). Give the cluster-facing address when `host` is public."""
    internal_port: int = 0
    """Port of the internal gRPC server; 0: any free port (reported in the ready line and status)."""
    policy: str = "round_robin"
    max_queued_requests: int = 256
    max_queued_tokens: int = 262144
    request_timeout_s: float = 300.0
    prefill_retries: int = 2
    max_migrations: int = 2
    local_prefill_threshold: int = 0
    """A prompt is prefilled on its decode worker when that worker would compute at most this many of its tokens
    (under the kv_aware policy the tokens it does not already hold, by the KV index; else the whole prompt); 0 disables."""
    heartbeat_timeout_s: float = 5.0
    stall_timeout_s: float = 30.0
    """A stream silent this long after its first token migrates to another decode worker if its worker
    is out of rotation by then (missed heartbeats: hung or paused); 0 disables (the deadline still applies)."""
    num_cpus: float = 0.25
    """Logical CPUs the router actor reserves under Ray (it tokenizes and relays; no model)."""
    resources: dict[str, float] = field(default_factory=dict)
    """Custom Ray resources of the router's bundle (e.g. one only the head node has, to pin it there)."""
    kv_pull: bool = False
    """A prefill worker may pull a prompt's prefix from the worker the KV index says holds more of it than it
    does (when its measured rates say moving beats computing: kvtransfer/prefix.py)."""
    shadow_check_fraction: float = 0.01
    """Share of disaggregated greedy requests recomputed colocated on a decode worker and compared (the
    canary, router/shadow.py: a difference counts in pdserve_disagg_divergence_total); 0 disables."""
    api_keys: list[str] = field(default_factory=list)
    """Keys accepted on the public API (`Authorization: Bearer KEY`); empty: no authentication.
    Keys in the environment variable PDSERVE_API_KEYS (comma-separated) are accepted too."""

    def validate(self, prefix: str) -> None:
        if not isinstance(self.api_keys, list) or not all(isinstance(k, str) and k for k in self.api_keys):
            raise ConfigError(f"{prefix}.api_keys", "must be a list of non-empty strings")
        if not isinstance(self.internal_host, str):
            raise ConfigError(f"{prefix}.internal_host", "must be a string (empty: the router's host)")
        for name in ("grpc_port", "http_port", "internal_port"):
            value = getattr(self, name)
            if not isinstance(value, int) or not 0 <= value <= 65535:
                raise ConfigError(f"{prefix}.{name}", f"must be a port number in [0, 65535] (0 = any free port), got {value!r}")
        one_of(f"{prefix}.policy", self.policy, ROUTING_POLICIES)
        for name in ("max_queued_requests", "max_queued_tokens"):
            positive_int(f"{prefix}.{name}", getattr(self, name))
        for name in ("prefill_retries", "max_migrations", "local_prefill_threshold"):
            non_negative_int(f"{prefix}.{name}", getattr(self, name))
        positive_float(f"{prefix}.request_timeout_s", self.request_timeout_s)
        positive_float(f"{prefix}.heartbeat_timeout_s", self.heartbeat_timeout_s)
        if not is_number(self.stall_timeout_s) or self.stall_timeout_s < 0:
            raise ConfigError(f"{prefix}.stall_timeout_s", f"must be a number >= 0 (0 = off), got {self.stall_timeout_s!r}")
        positive_float(f"{prefix}.num_cpus", self.num_cpus)
        if not isinstance(self.kv_pull, bool):
            raise ConfigError(f"{prefix}.kv_pull", f"must be true or false, got {self.kv_pull!r}")
        if not is_number(self.shadow_check_fraction) or not 0 <= self.shadow_check_fraction <= 1:
            raise ConfigError(f"{prefix}.shadow_check_fraction", f"must be a number in [0, 1] (0 = off), got {self.shadow_check_fraction!r}")
        custom_resources(f"{prefix}.resources", self.resources)


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
    resources: dict[str, float] = field(default_factory=dict)
    """Custom Ray resources of each worker's bundle (node pinning, accelerator types)."""
    tensor_parallel_size: int = 1
    """Ranks per worker: the model split over this many processes (one GPU each on CUDA) on one node.
    It must divide the model's attention and KV heads."""

    def validate(self, prefix: str) -> None:
        for name in ("replicas", "min_replicas", "max_replicas"):
            non_negative_int(f"{prefix}.{name}", getattr(self, name))
        if self.min_replicas > self.max_replicas:
            raise ConfigError(f"{prefix}.min_replicas", f"({self.min_replicas}) must be <= max_replicas ({self.max_replicas})")
        if not self.min_replicas <= self.replicas <= self.max_replicas:
            raise ConfigError(f"{prefix}.replicas", f"({self.replicas}) must be within [min_replicas, max_replicas] = [{self.min_replicas}, {self.max_replicas}]")
        for name in ("num_cpus", "num_gpus"):
            value = getattr(self, name)
            if not is_number(value) or value < 0:
                raise ConfigError(f"{prefix}.{name}", f"must be a number >= 0, got {value!r}")
        one_of(f"{prefix}.placement_strategy", self.placement_strategy, PLACEMENT_STRATEGIES)
        if self.num_cpus + self.num_gpus <= 0:
            raise ConfigError(f"{prefix}.num_cpus", "num_cpus and num_gpus are both 0: a worker must reserve some CPU or GPU")
        if self.num_threads is not None:
            positive_int(f"{prefix}.num_threads", self.num_threads)
        custom_resources(f"{prefix}.resources", self.resources)
        positive_int(f"{prefix}.tensor_parallel_size", self.tensor_parallel_size)


@dataclass(frozen=True)
class PoolsConfig:
    prefill: PoolConfig = field(default_factory=PoolConfig)
    decode: PoolConfig = field(default_factory=PoolConfig)

    def validate(self, prefix: str) -> None:
        if self.decode.min_replicas < 1:
            raise ConfigError(f"{prefix}.decode.min_replicas", "must be >= 1: every request needs a decode worker")


@dataclass(frozen=True)
class PrefillScalingConfig:
    """Prefill pool signals: work waiting to be prefilled, and TTFT."""

    queued_prompt_tokens_per_worker: int = 4096
    """Scale up when the pool's queued prompt tokens exceed this many per worker."""
    ttft_slo_s: float = 2.0
    """Scale up when the router's TTFT percentile over the last interval exceeds this."""

    def validate(self, prefix: str) -> None:
        positive_int(f"{prefix}.queued_prompt_tokens_per_worker", self.queued_prompt_tokens_per_worker)
        positive_float(f"{prefix}.ttft_slo_s", self.ttft_slo_s)


@dataclass(frozen=True)
class DecodeScalingConfig:
    """Decode pool signals: KV cache usage, running requests, and inter-token latency."""

    kv_usage: float = 0.8
    """Scale up when the pool's mean KV-block usage (0..1) exceeds this."""
    running_requests_per_worker: int = 64
    """Scale up when the pool runs more than this many requests per worker."""
    itl_slo_s: float = 0.2
    """Scale up when the router's inter-token latency percentile over the last interval exceeds this."""

    def validate(self, prefix: str) -> None:
        if not is_number(self.kv_usage) or not 0 < self.kv_usage <= 1:
            raise ConfigError(f"{prefix}.kv_usage", f"must be a fraction in (0, 1], got {self.kv_usage!r}")
        positive_int(f"{prefix}.running_requests_per_worker", self.running_requests_per_worker)
        positive_float(f"{prefix}.itl_slo_s", self.itl_slo_s)


@dataclass(frozen=True)
class AutoscalerConfig:
    """The controller's per-pool autoscaler (deploy/autoscaler.py); pools stay in [min_replicas, max_replicas]."""

    enabled: bool = False
    interval_s: float = 5.0
    """How often the controller samples the workers' Stats and the router's latencies."""
    upscale_cooldown_s: float = 30.0
    """Minimum time between two scale-ups of one pool."""
    downscale_cooldown_s: float = 120.0
    """A pool shrinks only after its load stayed low, and its size unchanged, for this long."""
    downscale_ratio: float = 0.5
    """Shrink when every signal, spread over one worker fewer, stays below this fraction of its threshold."""
    latency_quantile: float = 0.9
    """Quantile of TTFT / ITL compared with the SLOs."""
    drain_timeout_s: float = 300.0
    """Longest a scale-down waits for a worker's requests in flight to finish."""
    prefill: PrefillScalingConfig = field(default_factory=PrefillScalingConfig)
    decode: DecodeScalingConfig = field(default_factory=DecodeScalingConfig)
    adaptive: AdaptiveConfig = field(default_factory=AdaptiveConfig)

    def validate(self, prefix: str) -> None:
        if not isinstance(self.enabled, bool):
            raise ConfigError(f"{prefix}.enabled", f"must be true or false, got {self.enabled!r}")
        positive_float(f"{prefix}.interval_s", self.interval_s)
        for name in ("upscale_cooldown_s", "downscale_cooldown_s"):
            value = getattr(self, name)
            if not is_number(value) or value < 0:
                raise ConfigError(f"{prefix}.{name}", f"must be a number >= 0, got {value!r}")
        for name in ("downscale_ratio", "latency_quantile"):
            value = getattr(self, name)
            if not is_number(value) or not 0 < value < 1:
                raise ConfigError(f"{prefix}.{name}", f"must be a fraction in (0, 1), got {value!r}")
        positive_float(f"{prefix}.drain_timeout_s", self.drain_timeout_s)


@dataclass(frozen=True)
class SecurityConfig:
    """Shared secret on internal RPCs and the KV handshake, and optional TLS (docs/security.md)."""

    shared_secret: str = field(default="", repr=False)
    """Secret every router<->worker RPC and every KV transfer header must prove; empty: none.
    Falls back to shared_secret_file, then to the environment variable PDSERVE_SHARED_SECRET."""
    shared_secret_file: str = ""
    """File holding the secret (surrounding whitespace ignored), e.g. a mounted k8s Secret."""
    tls_cert_file: str = ""
    """PEM certificate (chain) of every gRPC server (router and workers) and of the HTTP server."""
    tls_key_file: str = ""
    """PEM private key of tls_cert_file; both or neither."""
    tls_ca_file: str = ""
    """PEM CA bundle internal clients verify the servers' certificate against; empty: system roots."""
    tls_server_name: str = ""
    """Name internal clients expect in the certificate, whatever address they dial; empty: the address's host."""
    allow_unauthenticated: bool = False
    """Let a plain process (`python -m router|prefill_worker|decode_worker`) with no secret bind a
    non-loopback address (logged as a WARNING). `pdserve serve|up` always have a secret."""

    def validate(self, prefix: str) -> None:
        for name in ("shared_secret", "shared_secret_file", "tls_cert_file", "tls_key_file", "tls_ca_file", "tls_server_name"):
            if not isinstance(getattr(self, name), str):
                raise ConfigError(f"{prefix}.{name}", "must be a string")
        if self.shared_secret and self.shared_secret_file:
            raise ConfigError(f"{prefix}.shared_secret_file", "set shared_secret or shared_secret_file, not both")
        self._validate_secret(prefix)
        if not isinstance(self.allow_unauthenticated, bool):
            raise ConfigError(f"{prefix}.allow_unauthenticated", f"must be true or false, got {self.allow_unauthenticated!r}")
        if bool(self.tls_cert_file) != bool(self.tls_key_file):
            missing = "tls_key_file" if self.tls_cert_file else "tls_cert_file"
            raise ConfigError(f"{prefix}.{missing}", "TLS needs both tls_cert_file and tls_key_file")
        if (self.tls_ca_file or self.tls_server_name) and not self.tls_cert_file:
            which = "tls_ca_file" if self.tls_ca_file else "tls_server_name"
            raise ConfigError(f"{prefix}.{which}", "only meaningful with tls_cert_file and tls_key_file")
        for name in ("tls_cert_file", "tls_key_file", "tls_ca_file"):
            if getattr(self, name):
                pem_file(f"{prefix}.{name}", getattr(self, name))

    def _validate_secret(self, prefix: str) -> None:
        try:
            secret, source = secret_source(self.shared_secret, self.shared_secret_file)
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"{prefix}.shared_secret_file", f"cannot read {self.shared_secret_file}: {exc}") from None
        where = source if source == SECRET_ENV else f"{prefix}.{source}"
        if secret and len(secret) < MIN_SECRET_CHARS:
            raise ConfigError(where, f"the secret must be at least {MIN_SECRET_CHARS} characters, got {len(secret)}")
        if self.shared_secret_file and not secret:
            raise ConfigError(where, f"{self.shared_secret_file} is empty")


@dataclass(frozen=True)
class TracingConfig:
    """OpenTelemetry spans of each request (common/tracing.py; spans: docs/observability.md). Off by default."""

    enabled: bool = False
    exporter: str = "console"
    """console (stderr), file (JSON lines under `directory`) or otlp (needs `pip install 'pdserve[otlp]'`)."""
    endpoint: str = ""
    """otlp: the collector's address; empty: the exporter's default (OTEL_EXPORTER_OTLP_TRACES_ENDPOINT or
    OTEL_EXPORTER_OTLP_ENDPOINT, else localhost:4317 for grpc, localhost:4318 for http)."""
    protocol: str = "grpc"
    """otlp: grpc or http (protobuf over HTTP)."""
    directory: str = ""
    """file: each process appends its spans to `<service_name>-<role>-<pid>.jsonl` here."""
    service_name: str = "pdserve"
    """Prefix of each process's `service.name`: pdserve-router, pdserve-prefill, pdserve-decode."""
    sample_ratio: float = 1.0
    """Fraction of requests traced (decided once at the router; the workers follow its decision)."""

    def validate(self, prefix: str) -> None:
        if not isinstance(self.enabled, bool):
            raise ConfigError(f"{prefix}.enabled", f"must be true or false, got {self.enabled!r}")
        one_of(f"{prefix}.exporter", self.exporter, TRACE_EXPORTERS)
        one_of(f"{prefix}.protocol", self.protocol, tuple(OTLP_MODULES))
        for name in ("endpoint", "directory", "service_name"):
            if not isinstance(getattr(self, name), str):
                raise ConfigError(f"{prefix}.{name}", "must be a string")
        if not self.service_name:
            raise ConfigError(f"{prefix}.service_name", "must be a non-empty string")
        if not is_number(self.sample_ratio) or not 0 <= self.sample_ratio <= 1:
            raise ConfigError(f"{prefix}.sample_ratio", f"must be a fraction in [0, 1], got {self.sample_ratio!r}")
        if self.enabled and self.exporter == "file" and not self.directory:
            raise ConfigError(f"{prefix}.directory", "the file exporter needs a directory")
        if self.enabled and self.exporter == "otlp" and not _installed(OTLP_MODULES[self.protocol]):
            raise ConfigError(f"{prefix}.exporter", "otlp needs the optional OTLP exporter: pip install 'pdserve[otlp]'")


@dataclass(frozen=True)
class PdserveConfig:
    model_name: str = "smollm2-135m"
    """Name the API serves the model under (OpenAI `model` field)."""
    engine: EngineConfig = field(default_factory=EngineConfig)
    kv_transfer: KVTransferConfig = field(default_factory=KVTransferConfig)
    router: RouterConfig = field(default_factory=RouterConfig)
    pools: PoolsConfig = field(default_factory=PoolsConfig)
    autoscaler: AutoscalerConfig = field(default_factory=AutoscalerConfig)
    security: SecurityConfig = field(default_factory=SecurityConfig)
    tracing: TracingConfig = field(default_factory=TracingConfig)

    def with_router_ports(self, grpc_port: int | None = None, http_port: int | None = None) -> PdserveConfig:
        """This config with the router's ports overridden (CLI flags); None keeps the configured port."""
        changes = {k: v for k, v in (("grpc_port", grpc_port), ("http_port", http_port)) if v is not None}
        if not changes:
            return self
        router = dataclasses.replace(self.router, **changes)
        router.validate("router")
        return dataclasses.replace(self, router=router)

    def engine_for(self, role: str) -> EngineConfig:
        """The engine config of a `role` worker: torch threads default to its pool's CPU share."""
        pool = getattr(self.pools, role)
        threads = self.engine.num_threads or pool.num_threads or max(1, int(pool.num_cpus))
        return dataclasses.replace(self.engine, num_threads=threads, tensor_parallel_size=pool.tensor_parallel_size)

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
    reject_unknown(data, PdserveConfig, "")
    if "tensor_parallel_size" in _section(data, "engine"):
        raise ConfigError("engine.tensor_parallel_size", "is set per pool: pools.prefill.tensor_parallel_size, pools.decode.tensor_parallel_size")
    engine = EngineConfig.from_dict(_section(data, "engine"), prefix="engine")
    kv = _build(KVTransferConfig, _section(data, "kv_transfer"), "kv_transfer")
    router = _build(RouterConfig, _section(data, "router"), "router")
    pools_data = _section(data, "pools")
    reject_unknown(pools_data, PoolsConfig, "pools.")
    pools = PoolsConfig(
        prefill=_build(PoolConfig, _section(pools_data, "prefill", "pools."), "pools.prefill"),
        decode=_build(PoolConfig, _section(pools_data, "decode", "pools."), "pools.decode"),
    )
    pools.validate("pools")
    autoscaler = _build_autoscaler(_section(data, "autoscaler"))
    security = _build(SecurityConfig, _section(data, "security"), "security")
    tracing = _build(TracingConfig, _section(data, "tracing"), "tracing")
    model_name = data.get("model_name", engine.model)
    if not isinstance(model_name, str) or not model_name:
        raise ConfigError("model_name", "must be a non-empty string")
    return PdserveConfig(model_name=model_name, engine=engine, kv_transfer=kv, router=router, pools=pools, autoscaler=autoscaler,
                         security=security, tracing=tracing)


def _build_autoscaler(data: dict) -> AutoscalerConfig:
    reject_unknown(data, AutoscalerConfig, "autoscaler.")
    prefill = _build(PrefillScalingConfig, _section(data, "prefill", "autoscaler."), "autoscaler.prefill")
    decode = _build(DecodeScalingConfig, _section(data, "decode", "autoscaler."), "autoscaler.decode")
    adaptive = _build(AdaptiveConfig, _section(data, "adaptive", "autoscaler."), "autoscaler.adaptive")
    flat = {k: v for k, v in data.items() if k not in ("prefill", "decode", "adaptive")}
    return _build(AutoscalerConfig, {**flat, "prefill": prefill, "decode": decode, "adaptive": adaptive}, "autoscaler")


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # a parent package is missing
        return False


def _section(data: dict, key: str, prefix: str = "") -> dict:
    value = data.get(key) or {}
    if not isinstance(value, dict):
        raise ConfigError(f"{prefix}{key}", "must be a mapping")
    return value


def _build(cls: type, data: dict, prefix: str):
    reject_unknown(data, cls, prefix + ".")
    try:
        obj = cls(**data)
    except TypeError as exc:
        raise ConfigError(prefix, str(exc)) from None
    obj.validate(prefix)
    return obj

"""Engine configuration: one typed object, validated once, errors name the field.

Torch-free (it sits in common/, below the engine): the router, the launcher and the config loader
read it without loading the model runtime.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from common.hardware import auto_dtype
from common.validation import ConfigError, is_number, non_negative_int, one_of, positive_int, reject_unknown

BLOCK_SIZES = (8, 16, 32, 64, 128)
OPTIONAL = ("num_kv_blocks", "max_model_len", "num_threads")
KV_POLICIES = ("max_utilization", "guaranteed_no_evict")
DTYPES = ("auto", "float32", "bfloat16", "float16")


SPECULATIVE_METHODS = ("off", "ngram")


@dataclass(frozen=True)
class SpeculativeConfig:
    """`engine.speculative`: propose tokens cheaply, verify them in one forward (engine.speculative)."""

    method: str = "off"
    """off, or ngram (prompt lookup: the tokens that followed the latest earlier occurrence of the last n tokens)."""
    num_speculative_tokens: int = 4
    """Most tokens proposed per request and step (k): a verified step yields 1..k+1 tokens."""
    ngram_min: int = 2
    ngram_max: int = 4
    """Longest and shortest suffix the ngram proposer looks up (it tries the longest first)."""
    adaptive: bool = True
    """Speculate in a step only while the measured cost model says it pays (false: whenever a proposal exists)."""

    def validate(self, prefix: str) -> None:
        one_of(f"{prefix}.method", self.method, SPECULATIVE_METHODS)
        for name in ("num_speculative_tokens", "ngram_min", "ngram_max"):
            positive_int(f"{prefix}.{name}", getattr(self, name))
        if self.ngram_max < self.ngram_min:
            raise ConfigError(f"{prefix}.ngram_max", f"must be >= ngram_min ({self.ngram_min}), got {self.ngram_max!r}")
        if not isinstance(self.adaptive, bool):
            raise ConfigError(f"{prefix}.adaptive", f"must be true or false, got {self.adaptive!r}")

    @property
    def enabled(self) -> bool:
        return self.method != "off"



def subsection(cls, value, prefix: str):
    """A nested section of the engine config (`engine.speculative`, `engine.kv_tier`) as its typed object:
    kept as is when already one, built from a mapping (unknown fields refused) otherwise."""
    if isinstance(value, cls):
        return value
    if not isinstance(value, dict):
        raise ConfigError(prefix, f"must be a mapping, got {value!r}")
    reject_unknown(value, cls, prefix + ".")
    return cls(**value)


KV_TIER_KINDS = ("off", "memory", "disk")


@dataclass(frozen=True)
class KVTierConfig:
    """`engine.kv_tier`: where blocks evicted from the KV pool go instead of being lost (engine.kv_tier)."""

    kind: str = "off"
    """off; memory (host memory: pinned on a GPU worker); disk (files in `directory`)."""
    budget_mb: int = 1024
    """Bytes the tier may hold; past it, its least recently used blocks are dropped."""
    directory: str | None = None
    """disk: where block files go (None: a fresh temporary directory, removed when the engine closes)."""

    def validate(self, prefix: str) -> None:
        one_of(f"{prefix}.kind", self.kind, KV_TIER_KINDS)
        positive_int(f"{prefix}.budget_mb", self.budget_mb)
        if self.directory is not None and (not isinstance(self.directory, str) or not self.directory):
            raise ConfigError(f"{prefix}.directory", f"must be a non-empty path, got {self.directory!r}")

    @property
    def enabled(self) -> bool:
        return self.kind != "off"



@dataclass(frozen=True)
class EngineConfig:
    model: str = "smollm2-135m"
    """Alias `smollm2-135m`, a local HF directory or a .gguf file."""
    dtype: str = "auto"
    """Weights, activations and KV. `auto` is resolved when the config is built (`common.hardware.auto_dtype`):
    bfloat16 on CUDA and on CPUs with AMX or AVX-512 BF16, float32 elsewhere; `dtype` then holds the result."""
    device: str = "cpu"
    block_size: int = 16
    kv_cache_memory_mb: int = 512
    """Memory budget of the paged KV pool; the number of blocks follows from it."""
    kv_cache_memory_fraction: float | None = None
    """CUDA: share of the device memory free after loading the weights for the KV pool (overrides
    kv_cache_memory_mb there; ignored on CPU)."""
    cuda_graph_max_batch: int = 256
    """CUDA: pure decode steps up to this batch replay CUDA graphs captured at batch buckets (0: never)."""
    num_kv_blocks: int | None = None
    """Exact number of KV blocks (overrides kv_cache_memory_mb; tests use it to force preemption)."""
    max_model_len: int | None = None
    """Longest prompt + output; defaults to the model's max_position_embeddings."""
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 128
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    kv_policy: str = "max_utilization"
    """KV admission: `max_utilization` admits while blocks for the next chunk are free and preempts
    (recompute) when the pool runs dry; `guaranteed_no_evict` admits a request only when blocks for its
    prompt + max_tokens are free beyond what admitted requests may still take, and never preempts."""
    num_threads: int | None = None
    """torch intra-op threads; None keeps torch's default."""
    seed: int = 0
    tensor_parallel_size: int = 1
    """Ranks (processes, one GPU each on CUDA) the model is split over; set per pool in a cluster config
    (`pools.<role>.tensor_parallel_size`), which `PdserveConfig.engine_for` copies here."""
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    kv_tier: KVTierConfig = field(default_factory=KVTierConfig)

    def __post_init__(self) -> None:
        object.__setattr__(self, "speculative", subsection(SpeculativeConfig, self.speculative, "engine.speculative"))
        object.__setattr__(self, "kv_tier", subsection(KVTierConfig, self.kv_tier, "engine.kv_tier"))
        self.validate()
        if self.dtype == "auto":
            object.__setattr__(self, "dtype", auto_dtype(self.device))

    def validate(self, prefix: str = "engine") -> None:
        if not isinstance(self.model, str) or not self.model:
            raise ConfigError(f"{prefix}.model", "must be a non-empty string")
        one_of(f"{prefix}.dtype", self.dtype, DTYPES)
        one_of(f"{prefix}.block_size", self.block_size, BLOCK_SIZES)
        if not (isinstance(self.device, str) and (self.device == "cpu" or self.device.split(":")[0] == "cuda")):
            raise ConfigError(f"{prefix}.device", f"must be cpu, cuda or cuda:N, got {self.device!r}")
        fraction = self.kv_cache_memory_fraction
        if fraction is not None and (not is_number(fraction) or not 0 < fraction < 1):
            raise ConfigError(f"{prefix}.kv_cache_memory_fraction", f"must be a number in (0, 1), got {fraction!r}")
        non_negative_int(f"{prefix}.cuda_graph_max_batch", self.cuda_graph_max_batch)
        one_of(f"{prefix}.kv_policy", self.kv_policy, KV_POLICIES)
        for name in ("kv_cache_memory_mb", "num_kv_blocks", "max_model_len", "max_num_batched_tokens", "max_num_seqs", "num_threads",
                     "tensor_parallel_size"):
            positive_int(f"{prefix}.{name}", getattr(self, name), allow_none=name in OPTIONAL)
        self.speculative.validate(f"{prefix}.speculative")
        self.kv_tier.validate(f"{prefix}.kv_tier")
        if self.kv_tier.enabled and self.tensor_parallel_size > 1:
            raise ConfigError(f"{prefix}.kv_tier.kind", "a KV tier needs tensor_parallel_size 1 (each rank's pool holds only its heads)")

    @classmethod
    def from_dict(cls, data: dict, prefix: str = "engine") -> EngineConfig:
        reject_unknown(data, cls, prefix + ".")
        try:
            return cls(**data)
        except ConfigError as exc:
            raise ConfigError(f"{prefix}.{exc.field.split('.', 1)[-1]}", str(exc).split(': ', 1)[-1]) from None

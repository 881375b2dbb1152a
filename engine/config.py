"""Engine configuration: one typed object, validated once, errors name the field."""

from __future__ import annotations

from dataclasses import dataclass, fields

MiB = 1 << 20


class ConfigError(ValueError):
    """A configuration field is invalid; `field` is its dotted name."""

    def __init__(self, field: str, message: str):
        self.field = field
        super().__init__(f"{field}: {message}")


@dataclass(frozen=True)
class EngineConfig:
    model: str = "smollm2-135m"
    """Alias `smollm2-135m`, a local HF directory or a .gguf file."""
    dtype: str = "float32"
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
    num_threads: int | None = None
    """torch intra-op threads; None keeps torch's default."""
    seed: int = 0

    def __post_init__(self) -> None:
        self.validate()

    def validate(self, prefix: str = "engine") -> None:
        def positive(name: str, value: int | None, allow_none: bool = False) -> None:
            if value is None and allow_none:
                return
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"{prefix}.{name}", f"must be an integer >= 1, got {value!r}")

        if not isinstance(self.model, str) or not self.model:
            raise ConfigError(f"{prefix}.model", "must be a non-empty string")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ConfigError(f"{prefix}.dtype", f"must be float32, bfloat16 or float16, got {self.dtype!r}")
        if self.block_size not in (8, 16, 32, 64, 128):
            raise ConfigError(f"{prefix}.block_size", f"must be one of 8, 16, 32, 64, 128, got {self.block_size!r}")
        positive("kv_cache_memory_mb", self.kv_cache_memory_mb)
        if not (isinstance(self.device, str) and (self.device == "cpu" or self.device.split(":")[0] == "cuda")):
            raise ConfigError(f"{prefix}.device", f"must be cpu, cuda or cuda:N, got {self.device!r}")
        fraction = self.kv_cache_memory_fraction
        if fraction is not None and (isinstance(fraction, bool) or not isinstance(fraction, int | float) or not 0 < fraction < 1):
            raise ConfigError(f"{prefix}.kv_cache_memory_fraction", f"must be a number in (0, 1), got {fraction!r}")
        if not isinstance(self.cuda_graph_max_batch, int) or isinstance(self.cuda_graph_max_batch, bool) or self.cuda_graph_max_batch < 0:
            raise ConfigError(f"{prefix}.cuda_graph_max_batch", f"must be an integer >= 0, got {self.cuda_graph_max_batch!r}")
        positive("num_kv_blocks", self.num_kv_blocks, allow_none=True)
        positive("max_model_len", self.max_model_len, allow_none=True)
        positive("max_num_batched_tokens", self.max_num_batched_tokens)
        positive("max_num_seqs", self.max_num_seqs)
        positive("num_threads", self.num_threads, allow_none=True)

    @classmethod
    def from_dict(cls, data: dict, prefix: str = "engine") -> EngineConfig:
        known = {f.name for f in fields(cls)}
        for key in data:
            if key not in known:
                raise ConfigError(f"{prefix}.{key}", f"unknown field (known: {', '.join(sorted(known))})")
        try:
            return cls(**data)
        except ConfigError as exc:
            raise ConfigError(f"{prefix}.{exc.field.split('.', 1)[-1]}", str(exc).split(': ', 1)[-1]) from None

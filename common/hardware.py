"""What this host offers the engine: the CPU's model name and the features that decide
`engine.dtype: auto` (`auto_dtype`), read once per process from /proc/cpuinfo.

Torch-free (common/): the engine config resolves `auto` with it when it is built, and the engine
and the benchmarks record it.
"""

from __future__ import annotations

import functools
import platform
from dataclasses import dataclass

BF16_FEATURES = ("amx_bf16", "avx512_bf16")
"""Either makes bfloat16 matmuls faster than float32 ones on a CPU (AMX tiles or AVX-512 BF16 dot products)."""
RELEVANT_FEATURES = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8")


@dataclass(frozen=True)
class CpuInfo:
    model: str
    features: tuple[str, ...]
    """The RELEVANT_FEATURES this CPU has, in that order."""

    @property
    def fast_bf16(self) -> bool:
        return any(f in self.features for f in BF16_FEATURES)

    def record(self) -> dict:
        """What benchmark JSONs keep about the CPU (under their machine / host record)."""
        return {"cpu": self.model, "cpu_features": list(self.features), "cpu_auto_dtype": "bfloat16" if self.fast_bf16 else "float32"}


@functools.cache
def cpu_info() -> CpuInfo:
    model, flags = platform.processor() or "unknown", set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name":
                    model = value.strip()
                elif key.strip() == "flags":
                    flags = set(value.split())
                    break
    except OSError:
        pass
    return CpuInfo(model, tuple(f for f in RELEVANT_FEATURES if f in flags))


def auto_dtype(device: str) -> str:
    """`engine.dtype: auto`: bfloat16 on CUDA and on CPUs with AMX or AVX-512 BF16, float32 elsewhere."""
    return "bfloat16" if device.startswith("cuda") else cpu_info().record()["cpu_auto_dtype"]

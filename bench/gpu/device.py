"""Device facts measured in the run: which device, its copy rate, and timing helpers.

`copy_rate_gbps` is the denominator of every bandwidth figure of the check (a device-to-device
`copy_` of a buffer much larger than the cache, read + written bytes counted, as HBM sees them).
"""

from __future__ import annotations

import platform
import statistics
import time
from collections.abc import Callable

import torch


def has_cuda() -> bool:
    return torch.cuda.is_available()


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def time_ms(fn: Callable[[], object], device: str, iters: int, warmup: int = 2) -> dict:
    """Median and min wall ms of `fn()` (synchronized around each call)."""
    for _ in range(warmup):
        fn()
    sync(device)
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append((time.perf_counter() - t0) * 1e3)
    return {"ms_median": round(statistics.median(times), 4), "ms_min": round(min(times), 4), "iters": iters}


def copy_rate_gbps(device: str, nbytes: int, iters: int = 10) -> dict:
    """Device-local copy: GB/s of bytes moved (read + write = 2 x nbytes per copy) and of bytes copied."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    src.fill_(1)
    dst = torch.empty_like(src)
    t = time_ms(lambda: dst.copy_(src), device, iters)
    copied = nbytes / (t["ms_min"] / 1e3) / 1e9
    return {"bytes": nbytes, "copy_gbps": round(copied, 3), "hbm_gbps": round(2 * copied, 3), **t}


def describe(device: str) -> dict:
    info = {"python": platform.python_version(), "torch": torch.__version__, "torch_cuda": torch.version.cuda, "device": device}
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except ImportError as exc:
        info["transformers"] = f"missing: {exc}"
    for name in ("triton", "cupy", "grpc", "google.protobuf", "numpy"):
        try:
            module = __import__(name, fromlist=["__version__"])
            info[name] = getattr(module, "__version__", "?")
        except Exception as exc:  # a probe reports, it does not stop
            info[name] = f"missing: {type(exc).__name__}: {exc}"
    if device.startswith("cuda"):
        props = torch.cuda.get_device_properties(0)
        free, total = torch.cuda.mem_get_info()
        info.update(gpu=props.name, gpu_total_gib=round(total / 2**30, 1), gpu_free_gib=round(free / 2**30, 1), sm_count=props.multi_processor_count)
    else:
        info["cpu"] = platform.processor() or platform.machine()
    return info

"""pdserve's C++ CPU kernels: built once per machine, loaded by the engine.

Lifecycle: `load()` compiles `paged_attention.cpp` with the host's compiler for the host's CPU
(`-march=native`) into `~/.cache/pdserve/kernels/<key>/` the first time it is called on a machine (the
setup step calls `pdserve kernels build`, so serving never waits for a compile), then imports the built
module; later calls and later processes reuse it. The key covers the source, torch's version and the
CPU's model and flags, so a cache shared between different machines never loads a foreign build.
When no compiler is there, `load()` returns None and `unavailable_reason()` says why; the engine then
decodes with the torch gather kernel (engine.paged_decode) and logs that reason.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
from pathlib import Path
from types import ModuleType

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("paged_attention.cpp")
CACHE_ROOT = Path(os.environ.get("PDSERVE_KERNEL_CACHE", Path.home() / ".cache" / "pdserve" / "kernels"))
FLAGS = ["-O3", "-march=native", "-fopenmp-simd"]

_failure: str | None = None


def _cpu_signature() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor()
    lines = [line for line in text.splitlines() if line.startswith(("model name", "flags"))]
    return "\n".join(sorted(set(lines)))


def build_key() -> str:
    digest = hashlib.sha256()
    for part in (SOURCE.read_bytes(), torch.__version__.encode(), _cpu_signature().encode(), " ".join(FLAGS).encode(), b"source copied"):
        digest.update(part)
    return digest.hexdigest()[:16]


@functools.cache
def load() -> ModuleType | None:
    """The compiled kernels, building them first if this machine has no build yet; None if they cannot be built."""
    global _failure
    from torch.utils import cpp_extension

    _put_ninja_on_path()
    key = build_key()
    directory = CACHE_ROOT / key
    directory.mkdir(parents=True, exist_ok=True)
    # Compiled from a copy inside the build directory: the build then does not depend on where this
    # checkout lives, so every checkout with the same source shares it instead of rebuilding it.
    source = directory / SOURCE.name
    if not source.exists() or source.read_bytes() != SOURCE.read_bytes():
        staged = directory / f"{SOURCE.name}.{os.getpid()}"
        staged.write_bytes(SOURCE.read_bytes())
        os.replace(staged, source)  # atomic: a process compiling meanwhile never sees half a file
    try:
        return cpp_extension.load(
            name=f"pdserve_paged_{key}",
            sources=[str(source)],
            extra_cflags=FLAGS,
            build_directory=str(directory),
            verbose=False,
        )
    except Exception as exc:  # no compiler, no ninja, a compile error: the torch kernel still works
        _failure = f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1] if str(exc).strip() else exc}"
        log.warning("pdserve's C++ kernels could not be built, decode attention uses the torch gather: %s", _failure)
        return None


def _put_ninja_on_path() -> None:
    """torch runs `ninja` from PATH; the `ninja` package (a dependency) has it in the environment's own bin
    directory, which is not on PATH when the environment's python is called directly."""
    try:
        import ninja
    except ImportError:
        return
    path = os.environ.get("PATH", "")
    if ninja.BIN_DIR not in path.split(os.pathsep):
        os.environ["PATH"] = os.pathsep.join([ninja.BIN_DIR, path]) if path else ninja.BIN_DIR


def unavailable_reason() -> str | None:
    """Why `load()` returned None (None when it did not, or was not called yet)."""
    return _failure

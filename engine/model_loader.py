"""Load a model reference (common/model_files.py resolves it to local files) with its tokenizer.

A `.gguf` file is dequantized by transformers on each load; the demo alias's GGUF is converted once
into an HF directory (`python -m engine.model_loader GGUF TARGET`, run by common.model_files).
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from common.errors import ModelLoadError
from common.model_files import resolve_model_path

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


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


def convert_gguf_to_hf(gguf: Path, target: Path) -> None:
    """Dequantize a GGUF checkpoint once into an HF directory at `target` (common.model_files runs this in a child)."""
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


if __name__ == "__main__":
    convert_gguf_to_hf(Path(sys.argv[1]), Path(sys.argv[2]))

"""Random-weight models for the device check, built on the device from carried tokenizer files.

The SmolLM2 tokenizer (tokenizer.json, tokenizer_config.json, config.json, no weights) travels in
`.gpu_assets/smollm2-tokenizer/` (made by scripts/gpu_wheels.sh, git-ignored, carried to the device);
here it falls back to the demo model's cache directory. Shapes:
  smollm2   SmolLM2-135M's own config.json (hidden 576, 30 layers, 9 heads, 3 KV heads)
  llama1b   hidden 2048, 16 layers, 32 heads, 8 KV heads, intermediate 8192, vocab 49152 (~1.2 B params)
  tiny      hidden 64, 2 layers: what `--quick --device cpu` runs in place of llama1b
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from common.model_files import cache_root
from engine.model_loader import DTYPES, LoadedModel

ASSETS = Path(__file__).resolve().parents[2] / ".gpu_assets" / "smollm2-tokenizer"

LLAMA_1B = dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, intermediate_size=8192)
TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128)


def tokenizer_dir() -> Path:
    for candidate in (os.environ.get("PDSERVE_GPU_ASSETS"), ASSETS, cache_root() / "models" / "smollm2-135m"):
        if candidate and (Path(candidate) / "tokenizer.json").exists():
            return Path(candidate)
    raise FileNotFoundError(f"no SmolLM2 tokenizer: run scripts/gpu_wheels.sh (it fills {ASSETS}) or set PDSERVE_GPU_ASSETS")


def _smollm2_config():
    from transformers import LlamaConfig

    return LlamaConfig.from_pretrained(str(tokenizer_dir()))


def build(shape: str, dtype: str, device: str, seed: int = 0) -> LoadedModel:
    """A random-weight Llama of `shape` ('smollm2', 'llama1b', 'tiny') with the SmolLM2 tokenizer."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    base = _smollm2_config()
    if shape == "smollm2":
        config = base
    else:
        sizes = LLAMA_1B if shape == "llama1b" else TINY
        config = LlamaConfig(
            vocab_size=base.vocab_size, max_position_embeddings=4096, rms_norm_eps=1e-5,
            tie_word_embeddings=False, bos_token_id=base.bos_token_id, eos_token_id=base.eos_token_id, **sizes,
        )
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    with torch.device(device):
        model = LlamaForCausalLM(config).to(DTYPES[dtype]).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir()))
    return LoadedModel(model=model, tokenizer=tokenizer, path=f"random:{shape}", dtype=DTYPES[dtype])


def weight_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())

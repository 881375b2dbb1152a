"""Small random-weight models saved as HF directories, with the demo model's tokenizer.

The demo model (SmolLM2-135M) has 9 attention heads and 3 KV heads, so tensor parallelism over 2 or
4 ranks cannot split it; these models can (8 heads, 4 KV heads by default), run in seconds on a CPU
and exercise what real checkpoints have (Qwen2: biases on q/k/v). Random weights still give a
deterministic greedy continuation that HF `generate` can be compared with token for token.
"""

from __future__ import annotations

from pathlib import Path

import torch

from common.model_files import DEMO_ALIAS, cache_root, resolve_model_path


def build_tiny_model(
    target: str | Path | None = None, *, arch: str = "qwen2", heads: int = 8, kv_heads: int = 4, layers: int = 4,
    hidden: int = 128, seed: int = 0,
) -> Path:
    """Save (once) and return an HF directory of a random `arch` ("qwen2" or "llama") model."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    name = f"tiny-{arch}-h{heads}-kv{kv_heads}-l{layers}-d{hidden}-s{seed}-r08"
    target = Path(target) if target else cache_root() / "models" / name
    if (target / "config.json").exists():
        return target
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(DEMO_ALIAS))
    config_cls, model_cls = {"qwen2": (Qwen2Config, Qwen2ForCausalLM), "llama": (LlamaConfig, LlamaForCausalLM)}[arch]
    config = config_cls(
        vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=2048,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, tie_word_embeddings=False,
        initializer_range=0.08,  # wider than the default 0.02: greedy continuations that vary instead of repeating one token
    )
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    staging = target.with_name(target.name + ".tmp")
    model.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging.rename(target)
    return target

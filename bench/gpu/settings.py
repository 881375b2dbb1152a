"""Sizes and time budgets of one device check: the full run (one H200, < 8 min) or `--quick` (tiny, CPU-testable)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CheckSettings:
    device: str = "cuda"
    quick: bool = False
    # (1) correctness: SmolLM2-shaped random model, fp32 token for token, bf16 identical share
    correctness_shape: str = "smollm2"
    correctness_prompts: int = 16
    correctness_tokens: int = 32
    # (2) throughput on the ~1B model in bf16
    big_shape: str = "llama1b"
    big_dtype: str = "bfloat16"
    num_requests: int = 256
    prompt_len: tuple[int, int] = (64, 512)
    output_len: tuple[int, int] = (32, 256)
    hf_static_requests: int = 128
    """transformers static batching runs the first N requests (its rate is per useful token, so a subset is fair)."""
    hf_static_batch: int = 32
    hf_continuous_requests: int = 256
    max_num_batched_tokens: int = 2048
    # (3) decode step vs the HBM bound
    decode_batches: tuple[int, ...] = (1, 32, 128)
    decode_context: int = 512
    decode_iters: int = 20
    copy_bytes: int = 1 << 30
    # (4) KV between processes
    kv_blocks: int = 4096
    """Blocks of the ~1B model's KV (all layers, K and V: 256 KiB each in bf16); the child copies half."""
    # (5) disaggregated path
    disagg_shape: str = "smollm2"
    disagg_requests: int = 16
    disagg_tokens: int = 32
    disagg_prompt_len: tuple[int, int] = (64, 512)
    budgets: tuple[tuple[str, int], ...] = (
        ("correctness", 60), ("engine_throughput", 70), ("hf_static", 60), ("hf_continuous", 60),
        ("decode_step", 60), ("kv_transfer", 45), ("disaggregated", 100),
    )

    def budget(self, section: str) -> int:
        return dict(self.budgets)[section]


def quick(device: str) -> CheckSettings:
    """Tiny sizes: the whole check end to end on a CPU in a few minutes (how it is tested)."""
    return CheckSettings(
        device=device, quick=True, correctness_shape="tiny", correctness_prompts=3, correctness_tokens=8,
        big_shape="tiny", big_dtype="float32", num_requests=12, prompt_len=(8, 48), output_len=(4, 16),
        hf_static_requests=8, hf_static_batch=4, hf_continuous_requests=8, max_num_batched_tokens=256,
        decode_batches=(1, 4), decode_context=32, decode_iters=3, copy_bytes=1 << 24, kv_blocks=64,
        disagg_shape="tiny", disagg_requests=3, disagg_tokens=6, disagg_prompt_len=(8, 40),
        budgets=(
            ("correctness", 60), ("engine_throughput", 60), ("hf_static", 60), ("hf_continuous", 60),
            ("decode_step", 60), ("kv_transfer", 60), ("disaggregated", 150),
        ),
    )

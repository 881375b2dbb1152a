"""Which attends a whole prompt on a CPU with the C++ kernel: the kernel, as a row of many queries, or torch's SDPA.

Both sum as transformers does (the kernel as torch's CPU flash attention, on the CPUs where that order was
measured), so the choice is speed alone, and it differs between CPUs: on an Intel Xeon with AMX torch's flash
attention packs a bf16 prompt for the AMX tiles and attends it ~3x faster than the kernel; on a Zen 4 EPYC
(AVX512-BF16, no AMX) the kernel's bf16 dot products attend it 2-3.5x faster than SDPA (prompts of 128 and
512 tokens, 1 thread; 1.5-1.7x before its passes kept their sums in registers), and in float32 the kernel, which
scores a prompt's K tiles transposed, takes 0.53 of SDPA's time (4.8 against 8.9 ms).

SDPA is the call transformers makes on a prompt, so through it a prompt alone in its step reaches the LM head
as transformers' own bits (tests/unit/test_engine_prompt_logits.py); the kernel's sums follow torch's only where
they were measured, and a bf16 prompt's hidden state can then differ by a bf16 step. So the kernel has to earn
the switch: it takes whole prompts only where it needs at most KERNEL_SHARE of SDPA's time. In the engine a
prompt's attention is a share of a prefill step (~9 % in float32, ~25 % in bf16 on the Zen 4), and a float32
kernel 12 % faster than SDPA measured as a tie there (docs/benchmarks.md); the bf16 one, 39 % faster, as +10 %
prefill throughput, and the float32 one, 47 % faster, as float32 0.79-0.80 -> 0.81 of the engine bench's bound.

Lifecycle: the ModelRunner asks `kernel_attends_prompts(...)` once. The answer is measured the first time a
machine sees a (dtype, head geometry, thread count): prompts of PROMPT_LENGTHS tokens through both paths, the
paths alternating, each length's best of ROUNDS, the totals compared; then kept next to the kernels' build
(engine.kernels.keep_measured, as engine.small_matmul's crossovers) and read by every later process.
Chunks after cached keys follow the same answer: where the kernel takes whole prompts it takes them too, as
rows that read their context in place; elsewhere SDPA attends the long ones over their gathered context under
a mask and the kernel the short ones (engine.model_runner).
"""

from __future__ import annotations

import logging
import time
from functools import partial

import torch

from engine import kernels
from engine.attention import PromptChunk, prompts_through_sdpa
from engine.kv_cache import KVCache, KVLayout

log = logging.getLogger(__name__)

CHOICES_FILE = "prompt_attention.json"
PROMPT_LENGTHS = (128, 512)
ROUNDS = 3
KERNEL_SHARE = 0.8
"""The kernel attends whole prompts where it takes at most this share of SDPA's time."""


def kernel_attends_prompts(dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int, block_size: int) -> bool:
    """Whether whole prompts go to the C++ kernel (True) or to SDPA one by one, as measured on this machine."""
    key = choice_key(dtype, heads, kv_heads, head_dim)
    known = kernels.read_measured(CHOICES_FILE)
    if key not in known:
        kernel_s, sdpa_s = measure(dtype, heads, kv_heads, head_dim, block_size)
        known = {**kernels.read_measured(CHOICES_FILE), key: {"kernel_s": round(kernel_s, 6), "sdpa_s": round(sdpa_s, 6)}}
        kernels.keep_measured(CHOICES_FILE, known)
        log.info("whole prompts (%s): the C++ kernel %.2f ms, SDPA %.2f ms", key, kernel_s * 1e3, sdpa_s * 1e3)
    return known[key]["kernel_s"] <= KERNEL_SHARE * known[key]["sdpa_s"]


def choice_key(dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int) -> str:
    return f"{str(dtype).removeprefix('torch.')} {heads}/{kv_heads} heads x {head_dim}/{torch.get_num_threads()} threads"


@torch.inference_mode()
def measure(dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int, block_size: int) -> tuple[float, float]:
    """Seconds for one prompt of each of PROMPT_LENGTHS through the kernel and through SDPA (each length's best
    of ROUNDS), attended as the runner attends them: the kernel over blocks scattered in a pool, SDPA over the
    step's own k/v."""
    built = kernels.load()
    scale = head_dim**-0.5
    best = {"kernel": dict.fromkeys(PROMPT_LENGTHS, float("inf")), "sdpa": dict.fromkeys(PROMPT_LENGTHS, float("inf"))}
    generator = torch.Generator().manual_seed(0)
    for length in PROMPT_LENGTHS:
        q, k, v = (torch.randn(length, n, head_dim, generator=generator).to(dtype) for n in (heads, kv_heads, kv_heads))
        blocks = -(-length // block_size)
        pool = KVCache(KVLayout(num_layers=1, num_kv_heads=kv_heads, head_dim=head_dim, block_size=block_size, dtype=dtype), 2 * blocks)
        table = torch.randperm(2 * blocks, generator=generator)[:blocks].to(torch.int32)
        pool.write_tokens(0, table.tolist(), k, v)
        key_pool, value_pool = pool.key_caches[0], pool.value_caches[0]
        lens, starts = torch.tensor([length], dtype=torch.int32), torch.tensor([0, length], dtype=torch.int32)
        paths = {
            "kernel": partial(built.paged_decode, q, key_pool, value_pool, table.unsqueeze(0), lens, scale, starts),
            "sdpa": partial(prompts_through_sdpa, q, k, v, key_pool, value_pool, [PromptChunk(length)], scale),
        }
        for _ in range(ROUNDS):
            for name, run in paths.items():
                started = time.perf_counter()
                run()
                best[name][length] = min(best[name][length], time.perf_counter() - started)
    return sum(best["kernel"].values()), sum(best["sdpa"].values())

"""The model's attention-free ceilings: its forward with attention replaced by a function that returns
the query unchanged, so only the matmuls, norms and rotary embedding run, each as the engine runs it
(`_kernels_as_in_engine`: rotary embedding and RMSNorm in one pass, engine.llama_layers; few rows through
the small-matmul kernel in float32, decode rows through engine.one_row_linear's kernel in bf16, where the
engine sends them there; the rest through torch, bf16 weights reordered once for oneDNN: engine.linears).
`matmul_ceiling_forward` is one step of a batch of single decode tokens, `prefill_ceiling_forward` one
packed prompt chunk (bench.engine times it between the engine's prefill steps; `run_prefill_ceiling` in
a row); `workload_ceiling` combines them
into the best useful tokens/s any engine could reach on a workload here (the bound; the engine's
fraction of it is `engine_over_bound` among bench.engine's ratios). `run_memory_ceiling` measures how fast
one thread reads memory here, which prices what the attention-free bound leaves out and no decode
attention avoids: reading every decode token's cached K and V once (`bound_with_kv_read`)."""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable

import torch
from tqdm import tqdm

from bench.engine_workload import Workload
from engine import one_row_linear
from engine.model_runner import install_kernels

NOATTN_IMPLEMENTATION = "pdserve_noattn"


def _no_attention(module, query, key, value, attention_mask, **kwargs):
    """Attention 'disabled': hand the query back in the [batch, tokens, heads, dim] layout HF expects."""
    return query.transpose(1, 2), None


def _register_no_attention() -> str:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(NOATTN_IMPLEMENTATION, _no_attention)
    AttentionMaskInterface.register(NOATTN_IMPLEMENTATION, lambda *a, **k: None)
    return NOATTN_IMPLEMENTATION


def _kernels_as_in_engine(model: torch.nn.Module) -> one_row_linear.LoneRows | None:
    """What the engine's ModelRunner installs on its model (CPU): the Llama layers' and the linear layers' kernels."""
    return install_kernels(model, "cpu")


def matmul_ceiling_forward(model: torch.nn.Module, batch: int, position: int, vocab_size: int) -> Callable[[], None]:
    """The matmul ceiling's step, warmed up: one attention-free forward of `batch` single decode tokens at
    `position` (bench.engine times it step by step, alternating with the engine's own decode steps)."""
    model.set_attn_implementation(_register_no_attention())
    lone_rows = _kernels_as_in_engine(model)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab_size, (batch, 1), generator=gen)
    positions = torch.full((batch, 1), position, dtype=torch.long)

    @torch.inference_mode()
    def forward() -> None:
        if lone_rows is not None:
            lone_rows.set_all(decoding=True)
        model(input_ids=ids, position_ids=positions, use_cache=False)

    forward()
    forward()
    return forward


def step_record(batch: int, times: list[float], cpu_times: list[float]) -> dict:
    """Timed steps of `batch` tokens each: tokens/s over their total wall time (and CPU time), the median and fastest step."""
    median = statistics.median(times)
    return {
        "batch": batch,
        "steps": len(times),
        "step_ms_median": round(median * 1e3, 2),
        "step_ms_min": round(min(times) * 1e3, 2),
        "tokens_per_s": round(batch * len(times) / sum(times), 2),
        "tokens_per_s_median_step": round(batch / median, 2),
        "tokens_per_cpu_s": round(batch * len(times) / max(sum(cpu_times), 1e-9), 2),
    }


def prefill_ceiling_forward(model: torch.nn.Module, tokens: int, vocab_size: int) -> Callable[[], None]:
    """The prefill ceiling's forward, warmed up: the same attention-free forward on one packed prompt chunk of
    `tokens` tokens (logits of the last only), the most prompt tokens per second any engine gets out of these
    matmuls (bench.engine runs it between the engine's prefill steps, `PrefillCeiling`)."""
    model.set_attn_implementation(_register_no_attention())
    lone_rows = _kernels_as_in_engine(model)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab_size, (1, tokens), generator=gen)
    positions = torch.arange(tokens).unsqueeze(0)

    @torch.inference_mode()
    def forward() -> None:
        if lone_rows is not None:
            lone_rows.set_all(decoding=False)
        model(input_ids=ids, position_ids=positions, use_cache=False, logits_to_keep=1)

    forward()
    return forward


def prefill_record(tokens: int, times: list[float], interleaved: bool) -> dict:
    median = statistics.median(times)
    return {"tokens": tokens, "iters": len(times), "step_ms_median": round(median * 1e3, 2), "tokens_per_s": round(tokens / median, 2),
            "interleaved_with_engine": interleaved}


def run_prefill_ceiling(model: torch.nn.Module, tokens: int, iters: int, vocab_size: int) -> dict:
    """`iters` timed prefill ceiling forwards in a row."""
    forward = prefill_ceiling_forward(model, tokens, vocab_size)
    times = []
    for _ in tqdm(range(iters), desc="prefill ceiling", unit="fwd", file=sys.stderr, dynamic_ncols=True):
        t0 = time.perf_counter()
        forward()
        times.append(time.perf_counter() - t0)
    return prefill_record(tokens, times, interleaved=False)


@torch.inference_mode()
def run_memory_ceiling(megabytes: int = 512, iters: int = 5) -> dict:
    """Read bandwidth of this process's threads: a sum over a buffer far larger than the caches."""
    buffer = torch.ones(megabytes << 18, dtype=torch.float32)
    buffer.sum()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        buffer.sum()
        times.append(time.perf_counter() - t0)
    best = min(times)
    return {"bytes": buffer.numel() * 4, "iters": iters, "seconds_min": round(best, 4), "gb_per_s": round(buffer.numel() * 4 / best / 1e9, 2)}


def decode_kv_bytes(w: Workload, kv_bytes_per_token: int) -> int:
    """K and V bytes that decode attention reads over the workload: output token j of a request attends
    to its prompt plus j earlier outputs and itself."""
    total_tokens = sum(n * len(p) + n * (n + 1) // 2 for p, n in zip(w.prompts, w.output_lens))
    return total_tokens * kv_bytes_per_token


def workload_ceiling(r: dict, w: Workload, kv_bytes_per_token: int | None = None) -> dict:
    """What no engine gets past on this machine: every prompt token at the prefill ceiling's rate and
    every output token at the batch-64 decode ceiling's, attention free (decode at the smaller batches
    of a run's tail is slower still, so this bound is generous). With `kv_bytes_per_token` (all layers'
    K and V of one token) and `r["memory_ceiling"]`, also `bound_with_kv_read`: the same plus reading
    every decode step's cached KV once at the measured bandwidth (prefill attention still free)."""
    prompt_tokens = sum(len(p) for p in w.prompts)
    seconds = prompt_tokens / r["prefill_ceiling"]["tokens_per_s"] + w.useful_tokens / r["matmul_ceiling"]["tokens_per_s"]
    best = w.useful_tokens / seconds
    kv = {}
    if kv_bytes_per_token and "memory_ceiling" in r:
        kv_bytes = decode_kv_bytes(w, kv_bytes_per_token)
        kv_seconds = kv_bytes / (r["memory_ceiling"]["gb_per_s"] * 1e9)
        kv = {"decode_kv_bytes": kv_bytes, "kv_read_seconds": round(kv_seconds, 2),
              "bound_with_kv_read_tokens_per_s": round(w.useful_tokens / (seconds + kv_seconds), 2)}
    return {
        "prompt_tokens": prompt_tokens,
        "output_tokens": w.useful_tokens,
        "seconds": round(seconds, 2),
        "useful_tokens_per_s": round(best, 2),
        "max_possible_over_hf_static": round(best / r["hf_static"]["tokens_per_s"], 2),
        "max_possible_over_hf_continuous": round(best / r["hf_continuous"]["tokens_per_s"], 2),
        **kv,
    }

"""Device probe: learn in < 90 s what the GPU machine offers before the real check runs there.

Usage: `python -m bench.gpu.probe [--out DIR]` (scripts/gpu_probe.sh installs the carried wheels
first). Checks: imports of every package the plain-process path needs, the triton decode kernel
against the torch one, fp32 greedy == HF generate through the engine (decode steps from its CUDA
graphs), torch flex_attention compiling, transformers' continuous batching, graph vs eager logits of
one decode step, device copy GB/s, CUDA IPC between two processes. Every check prints OK / FAIL / SKIP(reason) with a timestamp and lands in DIR/probe.json at
once. CUDA-only checks SKIP on a machine without CUDA, so the probe is tested here on CPU.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import sys

import torch

from bench.gpu import correctness, ipc, models
from bench.gpu.device import copy_rate_gbps, describe, has_cuda
from bench.gpu.harness import Report, Skip, log, out_dir

MODULES = ("engine.engine", "kvtransfer", "prefill_worker.service", "decode_worker.service", "prefill_worker.main", "decode_worker.main", "router.main")


def check_imports() -> dict:
    failed = {}
    for name in MODULES:
        try:
            importlib.import_module(name)
        except Exception as exc:  # ImportError, or a version check in generated code
            failed[name] = f"{type(exc).__name__}: {exc}"
    if failed:
        raise RuntimeError(f"{len(failed)} of {len(MODULES)} failed: {failed}")
    return {"modules": list(MODULES)}


@functools.lru_cache(maxsize=1)
def _smollm2(device: str) -> tuple:
    """(loaded, transformers reference copy, engine) of the SmolLM2-shaped fp32 model, built once."""
    loaded = models.build("smollm2", "float32", device)
    reference = correctness.reference_copy(loaded)
    return loaded, reference, correctness.make_engine(loaded, device, max_num_seqs=8)


def check_greedy(device: str) -> dict:
    loaded, reference, engine = _smollm2(device)
    prompts = correctness.random_prompts(loaded.tokenizer, 3, (8, 40))
    hf = correctness.hf_greedy(reference, prompts, 16)
    got = correctness.engine_greedy(engine, prompts, 16)
    result = correctness.compare(got, hf)
    result["decode_steps_from_cuda_graphs"] = engine.runner.graphs.steps if engine.runner.graphs is not None else 0
    result["fallback_reason"] = engine.runner.fallback_reason
    if result["identical"] != result["prompts"]:
        raise RuntimeError(f"engine != HF generate: {result}")
    return result


def check_triton_kernel(device: str) -> dict:
    if not device.startswith("cuda"):
        raise Skip("no cuda")
    from engine.paged_decode import decode_torch, decode_triton

    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        kc, vc = torch.randn(2, 300, 16, 8, 64, device=device).to(dtype)
        q = torch.randn(64, 32, 64, device=device).to(dtype)
        table = torch.randint(0, 300, (64, 40), dtype=torch.int32, device=device)
        lens = torch.randint(1, 640, (64,), dtype=torch.int32, device=device)
        err = (decode_torch(q, kc, vc, table, lens, None).float() - decode_triton(q, kc, vc, table, lens, None).float()).abs().max()
        out[str(dtype)] = float(err)
    if out["torch.float32"] > 1e-4 or out["torch.bfloat16"] > 3e-2:
        raise RuntimeError(f"triton decode kernel differs from the torch one: {out}")
    return {"max_abs_err": out}


def check_flex_attention(device: str) -> dict:
    if not device.startswith("cuda"):
        raise Skip("no cuda")
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    q, k, v = (torch.randn(1, 8, 256, 64, device=device, dtype=torch.bfloat16) for _ in range(3))
    mask = create_block_mask(lambda b, h, qi, ki: qi >= ki, None, None, 256, 256, device=device)
    out = torch.compile(flex_attention)(q, k, v, block_mask=mask)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    return {"max_abs_err": float((out - ref).abs().max())}


def check_hf_continuous(device: str) -> dict:
    from bench.engine import Workload, run_hf_continuous

    loaded = models.build("tiny", "float32", device)
    prompts = correctness.random_prompts(loaded.tokenizer, 3, (8, 24))
    result = run_hf_continuous(loaded.model, Workload(prompts, [8, 8, 8]), 256, 0)
    return {"has_generate_batch": hasattr(loaded.model, "generate_batch"), **result}


def check_decode_graph(device: str) -> dict:
    if not device.startswith("cuda"):
        raise Skip("no cuda")
    from bench.gpu.graphcheck import capture_decode_step

    return capture_decode_step(_smollm2(device)[2], batch=4)


def check_memcpy(device: str) -> dict:
    if not device.startswith("cuda"):
        raise Skip("no cuda")
    return copy_rate_gbps(device, 1 << 30)


def check_ipc(device: str) -> dict:
    if not device.startswith("cuda"):
        raise Skip("no cuda")
    return ipc.ipc_copy(device, num_blocks=512, block_numel=16 * 8 * 64 * 16, dtype=torch.bfloat16, timeout=60)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.gpu.probe")
    parser.add_argument("--out", default=None, help="folder for probe.json (default $OUT, else ./gpu_out)")
    args = parser.parse_args(argv)
    device = "cuda" if has_cuda() else "cpu"
    report = Report(out_dir(args.out) / "probe.json", {"probe": describe(device)})
    log(f"probe on {device}: {report.data['probe']}")
    report.section("imports", 30, check_imports)
    report.section("triton_decode_kernel", 30, lambda: check_triton_kernel(device))
    report.section("greedy_fp32", 60, lambda: check_greedy(device))
    report.section("flex_attention_compile", 45, lambda: check_flex_attention(device))
    report.section("hf_continuous_batching", 60, lambda: check_hf_continuous(device))
    report.section("decode_cuda_graph", 60, lambda: check_decode_graph(device))
    report.section("memcpy", 20, lambda: check_memcpy(device))
    report.section("cuda_ipc", 45, lambda: check_ipc(device))
    failed = [k for k, v in report.data["sections"].items() if v["status"] in ("error", "timeout")]
    log(f"probe done: {len(failed)} failed {failed}; wrote {report.path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

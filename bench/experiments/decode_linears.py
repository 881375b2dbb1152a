"""Experiment: a bf16 decode step's linear layers through engine.one_row_linear's kernel against torch's GEMM.

    python -m bench.experiments.decode_linears [--threads 1] [--quick]

Two parts, each comparing the two in the same run (CPU with AVX512-BF16 where the kernel gives torch's
lone-row bits; elsewhere, as on a CPU with AMX or without the kernel, the experiment says so and stops):
  layers   one pass over the model's linear layers (SmolLM2-135M, bf16, in the model's order, so every
           weight comes from memory as in a forward) on inputs of 1 to 64 rows: the kernel on the weight
           packed for it, then torch's `F.linear`, alternating, best of 3 passes each. Checks on the way that
           the kernel gives every row torch's lone-row bits.
  engine   bench.engine's workload (64 requests, prompts 64-512, outputs 32-256, greedy) through two
           engines stepping in turn, each timed on its own steps: `kernel` as the engine runs by default
           (every layer the kernel reproduces takes a decode step's rows to it, up to the crossover measured
           on the machine), `torch` with only the layers whose lone rows sum differently (the MLP's down
           projection) doing so, as before the kernel served every layer. Outputs must be identical (the
           kernel gives torch's bits). Prints tokens/s of both and the ratio.
Writes bench/results/decode_linears.json.
"""

from __future__ import annotations

import sys
import time
from typing import Any

from bench.experiments import common

ROWS = (1, 2, 4, 8, 16, 24, 32, 48, 64)


def layer_passes(model, rows: tuple[int, ...]) -> list[dict[str, Any]]:
    import torch
    import torch.nn.functional as F

    from engine import kernels

    kernel = kernels.load()
    layers = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    packed = [kernel.pack_dim_pairs(layer.weight.detach()) for layer in layers]
    results = []
    for count in rows:
        inputs = {n: torch.randn(count, n).to(torch.bfloat16) for n in {layer.in_features for layer in layers}}
        best = {"kernel": float("inf"), "torch": float("inf")}
        with torch.inference_mode():
            for layer, words in zip(layers, packed):
                x = inputs[layer.in_features]
                if not torch.equal(kernel.one_row_linear(x, words), torch.cat([F.linear(row[None], layer.weight) for row in x])):
                    raise RuntimeError(f"the kernel does not give torch's lone rows for {tuple(layer.weight.shape)} here")
            for _ in range(3):
                for name in best:
                    started = time.perf_counter()
                    for layer, words in zip(layers, packed):
                        x = inputs[layer.in_features]
                        kernel.one_row_linear(x, words) if name == "kernel" else F.linear(x, layer.weight)
                    best[name] = min(best[name], time.perf_counter() - started)
        results.append({"rows": count, "kernel_ms": round(best["kernel"] * 1e3, 2), "torch_ms": round(best["torch"] * 1e3, 2),
                        "torch_over_kernel": round(best["torch"] / best["kernel"], 2)})
        common.log.info("%d rows: kernel %.1f ms, torch %.1f ms", count, best["kernel"] * 1e3, best["torch"] * 1e3)
    return results


def kernel_reproduces_torch(model, kernel) -> bool:
    """engine.one_row_linear's probe, per weight shape of the model's linear layers: the kernel gives torch's lone rows."""
    import torch

    from engine import one_row_linear

    layers = {tuple(m.weight.shape): m for m in model.modules() if isinstance(m, torch.nn.Linear)}
    return all(one_row_linear.verdict(m.weight.detach(), kernel.pack_dim_pairs(m.weight.detach()), kernel).reproduced for m in layers.values())


def engine_ab(settings) -> dict[str, Any]:
    from bench.engine import engine_config, warm_engine
    from bench.engine_workload import make_workload
    from engine import Engine, SamplingParams
    from engine.model_loader import load_model
    from engine.one_row_linear import OneRowLinear

    engines, workload = {}, None
    for name in ("kernel", "torch"):
        loaded = load_model(settings.model, dtype="bfloat16")  # one copy each: the layers' routing is per model
        workload = make_workload(settings, loaded.config.vocab_size, set(loaded.tokenizer.all_special_ids))
        engine = Engine(engine_config(settings, loaded, workload), loaded=loaded)
        if name == "torch":
            for layer in loaded.model.modules():
                if type(layer) is OneRowLinear and not layer.differs:
                    layer.few_rows = 0
        warm_engine(engine, workload)
        for i, (prompt, n) in enumerate(zip(workload.prompts, workload.output_lens)):
            engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=n, ignore_eos=True))
        engines[name] = engine
    seconds = dict.fromkeys(engines, 0.0)
    outputs: dict[str, dict[str, list[int]]] = {name: {} for name in engines}
    while any(engine.has_work() for engine in engines.values()):
        for name, engine in engines.items():
            if engine.has_work():
                started = time.perf_counter()
                for out in engine.step():
                    outputs[name].setdefault(out.request_id, []).extend(out.new_token_ids)
                seconds[name] += time.perf_counter() - started
    for engine in engines.values():
        stats = engine.stats()
        assert stats.free_blocks == stats.total_blocks, "KV blocks leaked"
    tokens = workload.useful_tokens
    rates = {name: round(tokens / s, 2) for name, s in seconds.items()}
    common.log.info("engine: kernel %.1f tok/s, torch %.1f tok/s", rates["kernel"], rates["torch"])
    return {"requests": settings.num_requests, "prompt_len": settings.prompt_len, "output_len": settings.output_len, "output_tokens": tokens, "seconds": {k: round(v, 2) for k, v in seconds.items()},
            "tokens_per_s": rates, "kernel_over_torch": round(rates["kernel"] / rates["torch"], 3),
            "outputs_identical": outputs["kernel"] == outputs["torch"]}


def main(argv: list[str] | None = None) -> int:
    parser = common.parser(__doc__, "decode_linears")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    parser.add_argument("--quick", action="store_true", help="tiny run (results under bench/results/quick/)")
    args = parser.parse_args(argv)
    info, started = common.begin(args.quick)
    import torch

    from bench.engine_workload import Settings
    from engine import kernels
    from engine.model_loader import load_model

    torch.set_num_threads(args.threads)
    kernel = kernels.load()
    if kernel is None or not kernel.one_row_linear_available():
        common.log.error("engine.one_row_linear's kernel is not built here (it needs AVX512-BF16 and a C++ toolchain)")
        return 1
    model = load_model("smollm2-135m", dtype="bfloat16").model
    if not kernel_reproduces_torch(model, kernel):
        common.log.error("torch sums a lone bf16 row here in an order engine.one_row_linear's kernel does not reproduce "
                         "(a CPU with AMX): the engine does not install the kernel here")
        return 1
    report = {
        "command": common.command_line(),
        "layers": layer_passes(model, (1, 8) if args.quick else ROWS),
        "engine": engine_ab(Settings(num_requests=4, prompt_len=(16, 64), output_len=(8, 16), threads=args.threads) if args.quick
                            else Settings(threads=args.threads)),
    }
    report["machine"] = common.finish(info, started)
    common.save("decode_linears", report)
    return 0


if __name__ == "__main__":
    sys.exit(main())

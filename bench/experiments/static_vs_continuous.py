"""Experiment: transformers static batching vs pdserve's continuous batching, same requests.

    python -m bench.experiments.static_vs_continuous [--num-requests 16] [--threads 1]

Part 1 reuses bench/engine.py (`bench.engine.run`): one seeded offline workload (random prompt
ids, random output lengths, greedy, EOS ignored) through transformers `generate` in static
batches, transformers' own continuous batching, and the pdserve engine in-process.
Part 2 sends the very same requests (prompt ids and output lengths, exported from part 1's
workload) through a served pdserve (router + one colocated decode worker with the same torch
thread count, unpinned) with bench.serve, all at once over gRPC: the cost of the serving path
(router, gRPC, streaming, detokenization) on top of the engine.

Writes bench/results/static_vs_continuous.json (summary + bench.engine's full result),
static_vs_continuous_served.json (bench.serve report, raw timestamps) and static_vs_continuous.png.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench import serve
from bench.cluster import BenchCluster, bench_config
from bench.experiments import common


def offline(args: argparse.Namespace):
    """bench.engine's comparison; returns (its result, the workload it ran)."""
    import torch

    from bench import engine as engine_bench
    from engine.model_loader import load_model

    if args.quick:
        settings = engine_bench.Settings(num_requests=args.num_requests or 6, seed=args.seed, prompt_len=(8, 24), output_len=(4, 12),
                                         threads=args.threads, hf_batch_size=4, max_num_batched_tokens=64, decode_batch=6,
                                         decode_steps=3, ceiling_iters=3, quick=True)
    else:
        settings = engine_bench.Settings(num_requests=args.num_requests or 16, seed=args.seed, threads=args.threads,
                                         prompt_len=tuple(args.prompt_len), output_len=tuple(args.output_len))
    loaded = load_model(settings.model)
    result = engine_bench.run(settings, loaded=loaded)
    special = set(getattr(loaded.tokenizer, "all_special_ids", None) or [])
    workload = engine_bench.make_workload(settings, loaded.config.vocab_size, special)
    threads = torch.get_num_threads()
    return result, workload, settings, threads


def served(workload, settings, threads: int, args: argparse.Namespace) -> dict[str, Any]:
    items = [{"prompt_ids": list(p), "output_len": int(n)} for p, n in zip(workload.prompts, workload.output_lens)]
    with tempfile.TemporaryDirectory() as tmp:
        dataset = Path(tmp) / "workload.json"
        dataset.write_text(json.dumps(items))
        config = bench_config("tcp", engine={"num_threads": threads, "max_num_batched_tokens": settings.max_num_batched_tokens,
                                             "max_num_seqs": max(64, len(items))})
        with BenchCluster(config, num_prefill=0, num_decode=1, pin=False, name="served") as cluster:
            argv = ["--grpc", cluster.grpc_address, "--label", "pdserve served", "--dataset", "file",
                    "--dataset-path", str(dataset), "--num-prompts", "0", "--request-rate", "inf", "--warmup", "1"]
            report = serve.run(argv + (["--skip-detokenize"] if args.skip_detokenize else []))
            report["cluster"] = cluster.describe()
    return report


def plot(rows: list[dict[str, Any]]) -> str:
    plt = common.pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    names = [r["system"] for r in rows]
    values = [r["tokens_per_s"] for r in rows]
    bars = ax.bar(names, values, color=["tab:gray", "tab:olive", "tab:blue", "tab:cyan"][: len(rows)])
    for bar, r in zip(bars, rows):
        ax.annotate(f"{r['tokens_per_s']:.0f} tok/s\n{r['vs_hf_static']:.1f}x static", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                    ha="center", va="bottom", fontsize=8)
    ax.set_ylabel("useful output tokens / s")
    ax.set_title("same requests: static batches vs continuous batching", fontsize=9)
    ax.grid(alpha=0.3, axis="y")
    return common.save_figure(fig, "static_vs_continuous.png")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = common.parser(__doc__, "static_vs_continuous")
    p.add_argument("--num-requests", type=int, default=None, help="default 16 (6 with --quick)")
    p.add_argument("--prompt-len", type=int, nargs=2, default=[64, 256], metavar=("MIN", "MAX"))
    p.add_argument("--output-len", type=int, nargs=2, default=[16, 128], metavar=("MIN", "MAX"))
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads (offline phases and the served worker); 1 keeps a shared 2-core box from thrashing")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--skip-detokenize", action="store_true", help="served: token ids only (no router detokenization)")
    p.add_argument("--no-served", action="store_true", help="offline comparison only")
    p.add_argument("--quick", action="store_true", help="6 tiny requests")
    return p.parse_args(argv)


def served_row(workload, settings, threads: int, args: argparse.Namespace) -> dict[str, Any]:
    """The same requests through a served pdserve; its full report is written next to the summary."""
    served_report = served(workload, settings, threads, args)
    path = common.RESULTS / "static_vs_continuous_served.json"
    serve.write_report(served_report, path, plots=False)
    m = served_report["runs"][0]["metrics"]
    return {"system": "pdserve_served", "what": "router + 1 colocated decode worker over gRPC, all requests at once",
            "useful_tokens": m["total_output_tokens"], "seconds": m["duration_s"], "tokens_per_s": m["output_throughput"],
            "ttft_ms_p50": m["ttft_ms"]["median"], "tpot_ms_p50": m["tpot_ms"]["median"], "failed": m["failed"],
            "raw": str(path.relative_to(common.REPO))}


def targets(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Each row against hf_static and the in-process engine; the design's two targets."""
    static, engine_tps = rows[0]["tokens_per_s"], rows[2]["tokens_per_s"]
    for r in rows:
        r["vs_hf_static"] = r["tokens_per_s"] / static if static else None
        r["vs_engine"] = r["tokens_per_s"] / engine_tps if engine_tps else None
    found = {
        "engine_over_hf_static": {"target": 6.0, "measured": rows[2]["vs_hf_static"]},
        "served_over_engine": {"target": 0.9, "measured": rows[3]["vs_engine"] if len(rows) > 3 else None},
    }
    for t in found.values():
        t["met"] = t["measured"] is not None and t["measured"] >= t["target"]
    return found


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    info, started = common.begin(args.quick)
    engine_result, workload, settings, threads = offline(args)
    rows = [
        {"system": "hf_static", "what": f"transformers generate, static batches of {settings.hf_batch_size}", **_rate(engine_result["hf_static"])},
        {"system": "hf_continuous", "what": "transformers continuous batching (init_continuous_batching)", **_rate(engine_result["hf_continuous"])},
        {"system": "pdserve_engine", "what": "pdserve Engine in-process (continuous batching, paged KV)", **_rate(engine_result["engine"])},
    ]
    if not args.no_served:
        rows.append(served_row(workload, settings, threads, args))
    report = {
        "experiment": "static_vs_continuous",
        "command": common.command_line(),
        "machine": info,
        "params": vars(args),
        "torch_threads": threads,
        "workload": {"num_requests": len(workload.prompts), "prompt_tokens": sum(len(p) for p in workload.prompts),
                     "output_tokens": int(sum(workload.output_lens)), "prompt_len": list(settings.prompt_len),
                     "output_len": list(settings.output_len), "seed": settings.seed},
        "rows": rows,
        "targets": targets(rows),
        "engine_bench": engine_result,
    }
    common.finish(info, started)
    report["plot"] = plot(rows)
    common.save("static_vs_continuous", report)
    for r in rows:
        print(f"{r['system']:16s} {r['tokens_per_s']:8.1f} tok/s  {r['vs_hf_static']:.2f}x hf_static", file=sys.stderr)
    return 0


def _rate(phase: dict[str, Any]) -> dict[str, Any]:
    return {"useful_tokens": phase["useful_tokens"], "seconds": phase["seconds"], "tokens_per_s": phase["tokens_per_s"]}


if __name__ == "__main__":
    sys.exit(main())

"""Serving benchmark: an open- or closed-loop load generator against a running server.

Usage (what `pdserve bench serve ARGS` runs; `python -m bench.serve ARGS` works too):

    pdserve bench serve --grpc 127.0.0.1:50051 --num-prompts 64 --request-rate 4 \
        --input-len 64:256 --output-len 32:128 --goodput ttft:500 tpot:100 --out bench/results/serve.json
    pdserve bench serve --url http://127.0.0.1:8000/v1 --max-concurrency 8 --dataset chat

Lifecycle of one run:
  1. build the workload (seeded; run i of several rates uses seed + i): prompts as token ids (gRPC)
     or random words (HTTP), output lengths, plus burst requests injected at `--burst-at` seconds;
     `--dataset random|chat|prefix|file` (file: replay a JSON list of prompts and output lengths);
  2. draw arrival times: Poisson (`--burstiness 1`) or gamma gaps at `--request-rate`, or all at
     t=0 (`inf`); `--max-concurrency` caps requests in flight (bursts are not capped);
  3. stream every request, stamping each streamed chunk on arrival (`time.perf_counter`);
  4. compute vLLM's serving metrics from those raw stamps (`compute_metrics`), the ITL inside and
     outside burst windows (`burst_itl`), and write the JSON (raw stamps included, so every figure
     can be recomputed) and PNG plots.

Metric definitions (as vLLM's benchmark_serving):
  TTFT  first streamed token - request sent
  E2E   last byte of the stream - request sent
  TPOT  (E2E - TTFT) / (output tokens - 1), over requests with more than one output token
  ITL   every gap between consecutive streamed chunks of a request (one token per chunk here)
  throughput  completed requests / duration, output tokens / duration, (input+output) / duration
  goodput     requests / duration that meet every SLO given (`--goodput ttft:MS tpot:MS e2el:MS`;
              a one-token request counts TPOT as 0)
Duration: from the first request sent to the last response finished.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import os
import platform
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from bench.servebench.clients import GrpcBackend, OpenAIBackend
from bench.servebench.loadgen import run_load
from bench.servebench.metrics import burst_itl, burst_windows, compute_metrics, parse_slos, summarize
from bench.servebench.plots import plot_itl_timeline, plot_report
from bench.servebench.records import CANCELLED, RequestRecord, streamed, token_stats
from bench.servebench.workload import DEFAULT_VOCAB, RequestSpec, arrival_times, build_workload, parse_range

log = logging.getLogger("bench.serve")
__all__ = [
    "CANCELLED", "DEFAULT_VOCAB", "GrpcBackend", "OpenAIBackend", "RequestRecord", "RequestSpec", "arrival_times",
    "build_parser", "build_workload", "burst_itl", "burst_windows", "compute_metrics", "main", "parse_range",
    "parse_slos", "plot_itl_timeline", "run", "run_load", "streamed", "summarize", "token_stats", "write_report",
]


# ---- driver --------------------------------------------------------------------------------------
def host_info() -> dict[str, Any]:
    return {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
            "loadavg": [round(x, 2) for x in os.getloadavg()]}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdserve bench serve", description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    target = p.add_mutually_exclusive_group(required=True)
    target.add_argument("--grpc", metavar="HOST:PORT", help="pdserve router gRPC address")
    target.add_argument("--url", metavar="URL", help="OpenAI-compatible base URL, e.g. http://127.0.0.1:8000/v1")
    p.add_argument("--model", default=None, help="model name sent with each request (HTTP default: first of /models)")
    p.add_argument("--endpoint", choices=["completions", "chat"], default="completions", help="HTTP endpoint")
    p.add_argument("--dataset", choices=["random", "chat", "prefix", "file"], default="random")
    p.add_argument("--dataset-path", default=None, help="--dataset file: JSON list of {prompt_ids|prompt, output_len}")
    p.add_argument("--num-prompts", type=int, default=32, help="main requests per run (file: 0 = all)")
    p.add_argument("--input-len", type=parse_range, default=(128, 128), metavar="N|MIN:MAX")
    p.add_argument("--output-len", type=parse_range, default=(64, 64), metavar="N|MIN:MAX")
    p.add_argument("--chat-scale", type=float, default=1.0, help="scales the chat mix's lengths")
    p.add_argument("--num-prefixes", type=int, default=4, help="prefix dataset: distinct shared prefixes")
    p.add_argument("--prefix-len", type=int, default=256, help="prefix dataset: tokens (words) per shared prefix")
    p.add_argument("--vocab", type=parse_range, default=DEFAULT_VOCAB, metavar="LO:HI", help="random token id range (gRPC)")
    p.add_argument("--request-rate", type=float, nargs="+", default=[math.inf],
                   help="requests/s (one run per value; inf: all at once)")
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the gaps (1: Poisson)")
    p.add_argument("--max-concurrency", type=int, default=None, help="cap on main requests in flight")
    p.add_argument("--burst-at", type=float, action="append", metavar="S", help="inject a burst S seconds in (repeatable)")
    p.add_argument("--burst-size", type=int, default=4)
    p.add_argument("--burst-prompt-len", type=int, default=1024)
    p.add_argument("--burst-output-len", type=int, default=4)
    p.add_argument("--stop-after-bursts", type=float, default=None, metavar="S",
                   help="S seconds after the last burst request finished, cancel the main requests still streaming "
                        "(their chunks still count for ITL) and drop those not sent")
    p.add_argument("--high-priority-fraction", type=float, default=0.0, metavar="F",
                   help="share of the main requests sent with --high-priority (the rest: 0); reports metrics per priority")
    p.add_argument("--high-priority", type=int, default=10, help="the priority of those requests (higher first)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                   help="generate exactly max_tokens (where the server supports it)")
    p.add_argument("--skip-detokenize", action="store_true", help="gRPC: ask the router for token ids only")
    p.add_argument("--goodput", nargs="+", metavar="KEY:MS", help="SLOs: ttft:MS tpot:MS e2el:MS")
    p.add_argument("--percentiles", default="50,90,99")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--request-timeout", type=float, default=600.0)
    p.add_argument("--warmup", type=int, default=1, help="requests sent (and discarded) before each run")
    p.add_argument("--label", default=None, help="name of this setup in the JSON and plots")
    p.add_argument("--out", type=Path, default=None, help="JSON path (PNG plots next to it)")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--no-progress", action="store_true")
    return p


async def _run_all(args: argparse.Namespace, slos: dict[str, float], percentiles: tuple[float, ...]) -> list[dict]:
    if args.grpc:
        backend = GrpcBackend(args.grpc, args.model, args)
    else:
        backend = OpenAIBackend(args.url, args.model, args)
        await backend.open()
    runs = []
    try:
        for i, rate in enumerate(args.request_rate):
            if args.warmup:
                short = (min(args.output_len[0], 16), min(args.output_len[1], 16))  # warm the path, don't run a benchmark
                warm = build_workload(argparse.Namespace(**{**vars(args), "dataset": "random" if args.dataset == "file" else args.dataset,
                                                            "num_prompts": args.warmup, "burst_at": None, "output_len": short,
                                                            "seed": args.seed + 10_000 + i}), math.inf, args.url is not None)
                await run_load(backend, warm, None, progress=False)
            # run i draws its prompts from seed + i: no prefix-cache hits on an earlier run's prompts
            specs = build_workload(argparse.Namespace(**{**vars(args), "seed": args.seed + i}), rate, as_text=args.url is not None)
            load_before = os.getloadavg()
            records, duration = await run_load(backend, specs, args.max_concurrency, progress=not args.no_progress,
                                               stop_after_bursts=args.stop_after_bursts)
            raw = [asdict(r) for r in records]
            run: dict[str, Any] = {
                "seed": args.seed + i,
                "label": f"{args.label + ' ' if args.label else ''}rate={rate:g}" + (f" conc={args.max_concurrency}" if args.max_concurrency else ""),
                "request_rate": None if math.isinf(rate) else rate,
                "burstiness": args.burstiness,
                "max_concurrency": args.max_concurrency,
                "loadavg_before": [round(x, 2) for x in load_before],
                "loadavg_after": [round(x, 2) for x in os.getloadavg()],
                "metrics": compute_metrics(raw, duration, slos, percentiles),
            }
            if any(r["group"] == "burst" for r in raw):
                run["metrics_by_group"] = {
                    g: compute_metrics([r for r in raw if r["group"] == g], duration, slos, percentiles) for g in ("main", "burst")}
                run["burst_itl"] = burst_itl(raw, burst_windows(raw), percentiles)
            if args.high_priority_fraction:
                run["metrics_by_priority"] = {str(p): compute_metrics([r for r in raw if r["group"] == "main" and r["priority"] == p],
                                                                      duration, slos, percentiles)
                                              for p in sorted({r["priority"] for r in raw if r["group"] == "main"})}
            run["requests"] = raw
            runs.append(run)
            _print_run(run)
    finally:
        await backend.close()
    return runs


def _print_run(run: dict) -> None:
    m = run["metrics"]
    lines = [f"== {run['label']}: {m['completed']} ok, {m['failed']} failed, {m['cancelled']} cancelled in {m['duration_s']:.2f} s",
             f"   throughput {m['request_throughput']:.3f} req/s, {m['output_throughput']:.1f} out tok/s, "
             f"{m['total_token_throughput']:.1f} tok/s" + (f", goodput {m['goodput']:.3f} req/s" if m["goodput"] is not None else "")]
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"):
        s = m[key]
        if s["count"]:
            lines.append(f"   {key[:-3]:5s} mean {s['mean']:8.1f}  median {s['median']:8.1f}  p90 {s.get('p90') or 0:8.1f}  p99 {s.get('p99') or 0:8.1f} ms")
    for priority, pm in (run.get("metrics_by_priority") or {}).items():
        t = pm["ttft_ms"]
        lines.append(f"   priority {priority:>5s}: {pm['completed']} ok, TTFT median {t['median'] or 0:8.1f}  p99 {t.get('p99') or 0:8.1f} ms")
    b = run.get("burst_itl")
    if b:
        lines.append(f"   ITL outside bursts p50 {b['outside_ms']['median'] or 0:.1f} p99 {b['outside_ms'].get('p99') or 0:.1f} ms; "
                     f"inside p50 {b['inside_ms']['median'] or 0:.1f} p99 {b['inside_ms'].get('p99') or 0:.1f} ms")
    print("\n".join(lines), file=sys.stderr)


def run(argv: list[str]) -> dict[str, Any]:
    """Runs the benchmark described by `argv` (the CLI's flags) and returns the report (JSON-ready)."""
    args = build_parser().parse_args(argv)
    slos = parse_slos(args.goodput)
    percentiles = tuple(float(x) for x in args.percentiles.split(",") if x)
    started = time.time()
    host = host_info()
    runs = asyncio.run(_run_all(args, slos, percentiles))
    host["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    report = {
        "bench": "serve",
        "created_unix": int(started),
        "backend": "grpc" if args.grpc else f"openai-{args.endpoint}",
        "target": args.grpc or args.url,
        "host": host,
        "args": {k: (list(v) if isinstance(v, tuple) else (str(v) if isinstance(v, Path) else v)) for k, v in vars(args).items()},
        "slos_ms": slos or None,
        "percentiles": list(percentiles),
        "definitions": DEFINITIONS,
        "runs": runs,
    }
    report["args"]["request_rate"] = [None if math.isinf(r) else r for r in args.request_rate]
    return report


DEFINITIONS = {
    "ttft": "first streamed token - request sent",
    "e2el": "end of stream - request sent",
    "tpot": "(e2el - ttft) / (output_tokens - 1), requests with > 1 output token",
    "itl": "gaps between consecutive streamed chunks (chunk_times_s) of each request",
    "goodput": "requests meeting every SLO / duration (TPOT of a 1-token request counts as 0)",
    "times": "requests[].start_s, end_s, chunk_times_s are seconds since the run started (perf_counter)",
}


def write_report(report: dict[str, Any], out: Path, plots: bool = True) -> list[str]:
    """Writes the JSON to `out` and, with `plots`, PNGs next to it; returns the paths written."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    paths = [str(out)]
    if plots:
        paths += plot_report(report, out.with_suffix(""))
    return paths


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    argv = sys.argv[1:] if argv is None else argv
    report = run(argv)
    args = report["args"]
    if args["out"]:
        for path in write_report(report, Path(args["out"]), plots=not args["no_plots"]):
            log.info("wrote %s", path)
    return 0 if all(r["metrics"]["completed"] for r in report["runs"]) else 1


if __name__ == "__main__":
    sys.exit(main())

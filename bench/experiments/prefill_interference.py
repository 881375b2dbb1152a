"""Experiment: does a burst of long prompts stall the decode stream?

    python -m bench.experiments.prefill_interference [--steady 8] [--burst-size 4] [--burst-prompt-len 1024]

A steady decode load (`--steady` concurrent requests, short prompts, long outputs) runs on the
decode worker; `--burst-at` seconds in, `--burst-size` prompts of `--burst-prompt-len` tokens
arrive at once. Three setups, every worker pinned to its own core with one torch thread
(bench/cluster.py):

  colocated           1 decode worker prefills locally, no chunked prefill (a prompt runs whole)
  colocated_chunked   the same with chunked prefill (`max_num_batched_tokens` = --chunk-budget)
  disaggregated       1 prefill worker (core 0) + 1 decode worker (core 1), KV over --transport

Reported: ITL p50/p99 of the steady requests inside the burst window (burst sent -> the last
burst prompt's first token) and outside it (steady state, see bench.serve.burst_itl).
Target: disaggregated ITL p99 inside the burst <= 1.5x its p99 outside.

The steady requests ask for long outputs and are cancelled by the load generator --tail-s seconds
after the last burst request finished (bench.serve --stop-after-bursts): their streams cover the
whole burst and a tail after it however slow the machine is, and their gaps all count for ITL.
Writes bench/results/prefill_interference.json (summary), prefill_interference_<setup>.json (the
full bench.serve report with raw token timestamps) and prefill_interference_{timeline,itl}.png.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from bench import serve
from bench.cluster import BenchCluster, bench_config
from bench.experiments import common

TARGET_RATIO = 1.5
SETUPS = ("colocated", "colocated_chunked", "disaggregated")


def setup_cluster(name: str, args: argparse.Namespace) -> BenchCluster:
    engine: dict[str, Any] = {}
    if name == "colocated":
        # without chunking a prompt must fit one step's budget next to the running decodes
        engine = {"enable_chunked_prefill": False, "max_num_batched_tokens": max(2048, args.burst_prompt_len + args.steady + 64)}
    elif name == "colocated_chunked":
        engine = {"enable_chunked_prefill": True, "max_num_batched_tokens": args.chunk_budget}
    else:
        engine = {"enable_chunked_prefill": True, "max_num_batched_tokens": max(2048, args.burst_prompt_len)}
    engine["kv_cache_memory_mb"] = args.kv_cache_mb  # steady streams + burst prompts without preemption
    config = bench_config(args.transport, engine=engine)
    return BenchCluster(config, num_prefill=1 if name == "disaggregated" else 0, num_decode=1, name=name)


def run_setup(name: str, args: argparse.Namespace) -> dict[str, Any]:
    cluster = setup_cluster(name, args)
    with cluster:
        argv = ["--grpc", cluster.grpc_address, "--label", name, "--warmup", "2", "--seed", str(args.seed),
                "--num-prompts", str(args.steady), "--max-concurrency", str(args.steady), "--request-rate", "inf",
                "--input-len", str(args.steady_prompt_len), "--output-len", str(args.steady_output_len),
                "--burst-at", str(args.burst_at), "--burst-size", str(args.burst_size),
                "--burst-prompt-len", str(args.burst_prompt_len), "--burst-output-len", str(args.burst_output_len),
                "--stop-after-bursts", str(args.tail_s)]
        report = serve.run(argv)
        report["cluster"] = cluster.describe()
    path = common.RESULTS / f"prefill_interference_{name}.json"
    serve.write_report(report, path, plots=False)
    return summarize_setup(name, path)


def summarize_setup(name: str, path) -> dict[str, Any]:
    """The summary row of one setup, recomputed from its saved bench.serve report (raw timestamps)."""
    import json

    report = json.loads(path.read_text())
    run = report["runs"][0]
    raw = run["requests"]
    split = serve.burst_itl(raw, serve.burst_windows(raw), tuple(report["percentiles"]))
    burst_metrics = serve.compute_metrics([r for r in raw if r["group"] == "burst"], run["metrics"]["duration_s"])
    keys = ("count", "median", "p90", "p99", "max")
    return {
        "setup": name,
        "cluster": {k: v for k, v in report["cluster"].items() if k != "config"},
        "engine": report["cluster"]["config"]["engine"],
        **{f"itl_{part}_ms": {k: split[f"{part}_ms"][k] for k in keys} for part in ("outside", "inside", "before", "after")},
        "p99_ratio": split.get("p99_ratio"),
        "p99_ratio_vs_before": split.get("p99_ratio_vs_before"),
        "burst_window_s": [round(w["end_s"] - w["start_s"], 3) for w in split["windows"]],
        "burst_ttft_ms": {k: burst_metrics["ttft_ms"][k] for k in ("mean", "max")},
        "failed": run["metrics"]["failed"],
        "errors": sorted({r["error"] for r in raw if r["error"] and r.get("finish_reason") != serve.CANCELLED}),
        "steady_tokens_streamed": sum(len(r["chunk_times_s"]) for r in raw if r["group"] == "main"),
        "loadavg": [run["loadavg_before"], run["loadavg_after"]],
        "raw": str(path.relative_to(common.REPO)),
    }


def plot(results: list[dict[str, Any]]) -> list[str]:
    plt = common.pyplot()
    fig, axes = plt.subplots(len(results), 1, figsize=(10, 2.8 * len(results)), squeeze=False)
    for ax, res in zip(axes[:, 0], results):
        report = json.loads((common.REPO / res["raw"]).read_text())
        run = report["runs"][0]
        serve.plot_itl_timeline(ax, run["requests"], run["burst_itl"]["windows"])
        ax.set_title(f"{res['setup']}: steady decode ITL (burst of {len([r for r in run['requests'] if r['group'] == 'burst'])} "
                     f"long prompts shaded); p99 inside/outside = {res['p99_ratio']:.2f}x" if res["p99_ratio"] else res["setup"], fontsize=9)
    timeline = common.save_figure(fig, "prefill_interference_timeline.png")

    fig, ax = plt.subplots(figsize=(7, 4))
    names = [r["setup"] for r in results]
    xs = range(len(names))
    width = 0.2
    for i, (key, label) in enumerate((("itl_outside_ms", "outside"), ("itl_inside_ms", "inside burst"))):
        ax.bar([x + (2 * i - 1) * width - width / 2 for x in xs], [r[key]["median"] or 0 for r in results], width, label=f"p50 {label}")
        ax.bar([x + (2 * i - 1) * width + width / 2 for x in xs], [r[key]["p99"] or 0 for r in results], width, label=f"p99 {label}")
    ax.set_xticks(list(xs), names)
    ax.set_ylabel("ITL (ms)")
    ax.set_yscale("log")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, axis="y")
    bars = common.save_figure(fig, "prefill_interference_itl.png")
    return [timeline, bars]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = common.parser(__doc__, "prefill_interference")
    p.add_argument("--setups", nargs="+", choices=SETUPS, default=list(SETUPS))
    p.add_argument("--steady", type=int, default=8, help="concurrent steady decode requests")
    p.add_argument("--steady-prompt-len", type=int, default=32)
    p.add_argument("--steady-output-len", type=int, default=1500, help="max_tokens of the steady requests (cancelled after the tail)")
    p.add_argument("--kv-cache-mb", type=int, default=1024)
    p.add_argument("--burst-at", type=float, default=5.0)
    p.add_argument("--burst-size", type=int, default=4)
    p.add_argument("--burst-prompt-len", type=int, default=1024)
    p.add_argument("--burst-output-len", type=int, default=4)
    p.add_argument("--tail-s", type=float, default=10.0, help="steady decoding kept after the last burst request finished")
    p.add_argument("--chunk-budget", type=int, default=256, help="colocated_chunked: max_num_batched_tokens")
    p.add_argument("--transport", default="tcp", choices=["tcp", "ucx"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="small run (tests, smoke): 4 steady, 2 x 256-token burst")
    p.add_argument("--resummarize", action="store_true",
                   help="no new run: recompute the summary and plots from the saved prefill_interference_<setup>.json")
    args = p.parse_args(argv)
    if args.quick:
        args.steady, args.burst_size, args.burst_prompt_len, args.burst_at, args.tail_s, args.kv_cache_mb = 4, 2, 256, 2.0, 3.0, 256
    return args


def target(results: list[dict[str, Any]]) -> dict[str, Any]:
    disagg = next((r for r in results if r["setup"] == "disaggregated"), None)
    ratio = disagg["p99_ratio"] if disagg else None
    strict = disagg["p99_ratio_vs_before"] if disagg else None
    return {
        "rule": f"disaggregated ITL p99 inside the burst <= {TARGET_RATIO}x its p99 outside",
        "ratio": ratio,
        "met": ratio is not None and ratio <= TARGET_RATIO,
        "ratio_vs_before": strict,
        "met_vs_before": strict is not None and strict <= TARGET_RATIO,
        "note": "outside = before and after the burst window; vs_before = only the steady state before the burst",
    }


def print_summary(report: dict[str, Any]) -> None:
    def f(x, digits=0):
        return "n/a" if x is None else f"{x:.{digits}f}"

    for r in report["results"]:
        o, i = r["itl_outside_ms"], r["itl_inside_ms"]
        print(f"{r['setup']:18s} ITL p50/p99 outside {f(o['median'])}/{f(o['p99'])} ms, inside {f(i['median'])}/{f(i['p99'])} ms, "
              f"p99 ratio {f(r['p99_ratio'], 2)} (vs before {f(r['p99_ratio_vs_before'], 2)}), failed {r['failed']}", file=sys.stderr)
    t = report["target"]
    print(f"target ({t['rule']}): {'met' if t['met'] else 'NOT met'} (ratio {f(t['ratio'], 2)}; "
          f"against the steady state before the burst {f(t['ratio_vs_before'], 2)})", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    info, started = common.begin(args.quick)
    if args.resummarize:
        previous = json.loads((common.RESULTS / "prefill_interference.json").read_text())
        info, params, command = previous["machine"], previous["params"], previous["command"]
        results = [summarize_setup(name, common.RESULTS / f"prefill_interference_{name}.json") for name in params["setups"]]
    else:
        params, command = vars(args), common.command_line()
        results = [run_setup(name, args) for name in args.setups]
    report = {"experiment": "prefill_interference", "command": command, "machine": info, "params": params,
              "target": target(results), "results": results}
    if not args.resummarize:
        common.finish(info, started)
    report["plots"] = plot(results)
    common.save("prefill_interference", report)
    print_summary(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())

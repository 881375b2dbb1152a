"""Experiment: goodput under latency SLOs across request rates, disaggregated vs colocated.

    python -m bench.experiments.goodput [--rates 0.5 1 2] [--slo ttft:4000 tpot:250]

Same two cores, same engine config (chunked prefill, `max_num_batched_tokens` = --budget), one
torch thread per worker, each worker pinned to its own core:

  disaggregated   1 prefill worker (core 0) + 1 decode worker (core 1), KV over --transport
  colocated       2 decode workers (cores 0, 1) that prefill locally; the router round-robins

Workload: the bench.serve chat-like length mix (scaled by --chat-scale), Poisson arrivals, one
bench.serve run per rate (run i uses seed + i, so no run hits another's prefix cache). Goodput =
completed requests per second that met every SLO (vLLM's definition).
Writes bench/results/goodput_<setup>.json (full bench.serve reports, raw timestamps included),
goodput.json (summary) and goodput.png.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from bench import serve
from bench.cluster import BenchCluster, bench_config
from bench.experiments import common

SETUPS = {"disaggregated": (1, 1), "colocated": (0, 2)}


def run_setup(name: str, args: argparse.Namespace) -> dict[str, Any]:
    num_prefill, num_decode = SETUPS[name]
    config = bench_config(args.transport, engine={"enable_chunked_prefill": True, "max_num_batched_tokens": args.budget})
    with BenchCluster(config, num_prefill=num_prefill, num_decode=num_decode, name=name) as cluster:
        argv = ["--grpc", cluster.grpc_address, "--label", name, "--dataset", "chat", "--chat-scale", str(args.chat_scale),
                "--num-prompts", str(args.num_prompts), "--request-rate", *map(str, args.rates), "--burstiness", "1",
                "--goodput", *args.slo, "--seed", str(args.seed), "--warmup", "2"]
        report = serve.run(argv)
        report["cluster"] = cluster.describe()
    path = common.RESULTS / f"goodput_{name}.json"
    serve.write_report(report, path, plots=False)
    rows = []
    for run in report["runs"]:
        m = run["metrics"]
        rows.append({
            "rate": run["request_rate"],
            "goodput": m["goodput"],
            "good": m["good_requests"],
            "completed": m["completed"],
            "failed": m["failed"],
            "request_throughput": m["request_throughput"],
            "output_throughput": m["output_throughput"],
            "ttft_ms": {k: m["ttft_ms"][k] for k in ("median", "p90", "p99")},
            "tpot_ms": {k: m["tpot_ms"][k] for k in ("median", "p90", "p99")},
            "itl_ms": {k: m["itl_ms"][k] for k in ("median", "p90", "p99")},
            "loadavg": [run["loadavg_before"], run["loadavg_after"]],
        })
    return {"setup": name, "cluster": {k: v for k, v in report["cluster"].items() if k != "config"},
            "engine": config["engine"], "slos_ms": report["slos_ms"], "by_rate": rows,
            "raw": str(path.relative_to(common.REPO))}


def plot(results: list[dict[str, Any]], slos: dict[str, float]) -> str:
    plt = common.pyplot()
    fig, (a1, a2, a3) = plt.subplots(1, 3, figsize=(14, 4))
    for res in results:
        rates = [r["rate"] for r in res["by_rate"]]
        a1.plot(rates, [r["goodput"] for r in res["by_rate"]], "o-", label=res["setup"])
        a2.plot(rates, [r["ttft_ms"]["p90"] for r in res["by_rate"]], "o-", label=res["setup"])
        a3.plot(rates, [r["tpot_ms"]["p90"] for r in res["by_rate"]], "o-", label=res["setup"])
    rates = [r["rate"] for r in results[0]["by_rate"]]
    a1.plot(rates, rates, ":", color="gray", label="offered")
    a1.set_ylabel("goodput (req/s)")
    a1.set_title("goodput " + " ".join(f"{k}<={v:g}ms" for k, v in slos.items()), fontsize=9)
    a2.set_ylabel("TTFT p90 (ms)")
    a3.set_ylabel("TPOT p90 (ms)")
    for ax, key in ((a2, "ttft"), (a3, "tpot")):
        if key in slos:
            ax.axhline(slos[key], color="tab:red", ls="--", lw=1, label="SLO")
        ax.set_yscale("log")
    common.style_axes((a1, a2, a3), "request rate (req/s)")
    return common.save_figure(fig, "goodput.png")


def main(argv: list[str] | None = None) -> int:
    p = common.parser(__doc__, "goodput")
    p.add_argument("--setups", nargs="+", choices=list(SETUPS), default=list(SETUPS))
    p.add_argument("--rates", type=float, nargs="+", default=[0.5, 1.0, 2.0])
    p.add_argument("--num-prompts", type=int, default=12, help="requests per rate")
    p.add_argument("--chat-scale", type=float, default=0.5)
    p.add_argument("--slo", nargs="+", default=["ttft:4000", "tpot:250"], metavar="KEY:MS")
    p.add_argument("--budget", type=int, default=512, help="max_num_batched_tokens (chunked prefill)")
    p.add_argument("--transport", default="tcp", choices=["tcp", "ucx"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="2 rates x 6 requests, small lengths")
    args = p.parse_args(argv)
    if args.quick:
        args.rates, args.num_prompts, args.chat_scale = [0.5, 2.0], 6, 0.25
    info, started = common.begin(args.quick)
    results = [run_setup(name, args) for name in args.setups]
    slos = serve.parse_slos(args.slo)
    report = {"experiment": "goodput", "command": common.command_line(), "machine": info, "params": vars(args),
              "slos_ms": slos, "results": results}
    common.finish(info, started)
    report["plot"] = plot(results, slos)
    common.save("goodput", report)
    for res in results:
        print(res["setup"], [(r["rate"], round(r["goodput"], 3)) for r in res["by_rate"]], file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""`pdserve plan`: the command line around sim/planner.py (docs/simulator.md).

    pdserve plan --profile gpu_h200_llama8b_bf16_estimate --trace TRACE.jsonl --slo-ttft 2000 --slo-itl 100 --max-gpus 256
    pdserve plan --profile cpu_epyc_avx2_smollm2_fp32 --rate 0.5 --prompt-len 64 512 --output-len 8 64 --max-gpus 3 --cores 2

Its stdout starts with `pdserve serve -c <written config>`; then the report's path and the pick's reason.
Exit status 3 when no candidate within --max-gpus meets the goal (no config is written; the report says
which came closest).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from common.mooncake import Scale, load_trace, select_window
from sim.cluster import ClusterSpec
from sim.planner import Goal, Limits, plan, report, write_config
from sim.profile import load_profile
from sim.router import POLICIES
from sim.workload import from_trace, synthetic


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="pdserve plan", description=__doc__.splitlines()[0])
    parser.add_argument("--profile", required=True, help="a profile file, or the name of one in sim/profiles/")
    src = parser.add_argument_group("workload: a Mooncake-format trace, or a synthetic distribution")
    src.add_argument("--trace", type=Path, default=None)
    src.add_argument("--trace-rate", type=float, default=None, help="compress the trace's arrivals to this mean rate (default: its own times)")
    src.add_argument("--requests", type=int, default=None, help="a window of whole conversations (default: every request)")
    src.add_argument("--tokens-per-block", type=int, default=None,
                     help="tokens per trace block (default: 512, the trace's real lengths, on a GPU profile; the profile's block size on a CPU one)")
    src.add_argument("--max-output", type=int, default=None, help="answers capped at this many tokens (default: none on GPU, 64 on CPU)")
    src.add_argument("--rate", type=float, default=None, help="synthetic: Poisson arrivals at this rate (req/s)")
    src.add_argument("--num-requests", type=int, default=1000, help="synthetic: how many")
    src.add_argument("--prompt-len", type=int, nargs=2, default=(256, 1024), metavar=("MIN", "MAX"))
    src.add_argument("--output-len", type=int, nargs=2, default=(32, 256), metavar=("MIN", "MAX"))
    src.add_argument("--seed", type=int, default=0)
    goal = parser.add_argument_group("goal")
    goal.add_argument("--slo-ttft", type=float, required=True, help="ms")
    goal.add_argument("--slo-itl", type=float, required=True, help="ms, held as each request's mean inter-token time (TPOT), as goodput counts it")
    goal.add_argument("--attainment", type=float, default=0.9, help="share of requests that must meet both SLOs")
    lim = parser.add_argument_group("search")
    lim.add_argument("--max-gpus", type=int, required=True, help="accelerators (GPUs; on a CPU profile, workers)")
    lim.add_argument("--policies", nargs="+", default=["round_robin", "kv_aware"], choices=POLICIES)
    lim.add_argument("--tp", type=int, nargs="+", default=None, help="TP sizes to try per pool (default: the profile's)")
    lim.add_argument("--cores", type=float, default=None, help="CPU profile: the cores all workers share (one host)")
    lim.add_argument("--kv-blocks", type=int, default=None, help="KV blocks per worker (default: the profile's capacity)")
    lim.add_argument("--budget", type=int, default=None, help="max_num_batched_tokens (default: the profile's)")
    lim.add_argument("--tier-blocks", type=int, default=0)
    lim.add_argument("--transport", default=None, help="a link the profile measured (default: its first)")
    out = parser.add_argument_group("outputs")
    out.add_argument("--out", type=Path, default=Path("pdserve-plan.yaml"), help="the config written")
    out.add_argument("--report", type=Path, default=None, help="the report (JSON; default: beside --out)")
    out.add_argument("--model", default=None, help="engine.model of the config (default: the profile's model)")
    return parser.parse_args(argv)


def build_workload(args: argparse.Namespace, profile):
    gpu = profile.device.startswith("cuda")
    slos = {"ttft": args.slo_ttft, "tpot": args.slo_itl}
    if args.trace is None:
        if args.rate is None:
            raise SystemExit("pdserve plan: give --trace FILE or --rate R (with --prompt-len and --output-len)")
        return (lambda f: synthetic(args.num_requests, args.rate * f, tuple(args.prompt_len), tuple(args.output_len),
                                    profile.block_size, args.seed, slos)), profile.block_size
    trace = select_window(load_trace(args.trace), requests=args.requests, seed=args.seed)
    tpb = args.tokens_per_block or (512 if gpu else profile.block_size)
    scale = Scale(tpb, max_output=args.max_output or (1 << 20 if gpu else 64))
    if args.trace_rate is None:
        t0 = trace[0].timestamp_ms
        base = [(r.timestamp_ms - t0) / 1000 for r in trace]
    else:
        base = None

    def workload(f: float):
        if base is None:
            return from_trace(trace, scale, rate=args.trace_rate * f, slos_ms=slos)
        return from_trace(trace, scale, slos_ms=slos, offsets=[t / f for t in base])

    return workload, tpb


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    profile = load_profile(args.profile)
    workload, block_tokens = build_workload(args, profile)
    base = ClusterSpec(cores=args.cores, kv_blocks=args.kv_blocks, max_num_batched_tokens=args.budget, tier_blocks=args.tier_blocks,
                       transport=args.transport, block_tokens=block_tokens)
    limits = Limits(args.max_gpus, tuple(args.policies), tuple(args.tp) if args.tp else None, base)
    result = plan(profile, workload, Goal({"ttft": args.slo_ttft, "tpot": args.slo_itl}, args.attainment), limits)
    report_path = args.report or args.out.with_suffix(".report.json")
    body = report(result)
    body["limits"] = {**{k: v for k, v in dataclasses.asdict(limits).items() if k != "base"}, "base": dataclasses.asdict(base)}
    body["command"] = "pdserve plan " + " ".join(sys.argv[2:] if argv is None else argv)
    report_path.parent.mkdir(parents=True, exist_ok=True)
    report_path.write_text(json.dumps(body, indent=1, default=str) + "\n")
    if result.chosen is None:
        print(f"no plan: {result.why}\nreport: {report_path}", file=sys.stderr)
        return 3
    path = write_config(result, args.out, args.model)
    print(f"pdserve serve -c {path}")
    print(f"report: {report_path} ({result.simulations} simulations)")
    print(result.why)
    return 0

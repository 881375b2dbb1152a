"""Experiment: the simulator at scale: its speed on the full conversation trace at 256 GPUs, and `pdserve plan`
on that trace at its real rate and compressed (more traffic), from the GPU profile estimate.

    python -m bench.experiments.sim_scale [--rates 1 4 16 32] [--docs]

speed  the 12,031-request Mooncake conversation trace at its real times and lengths (512-token blocks, answers
       uncapped) on 16 prefill + 16 decode workers of TP 8 and on 128 + 128 of TP 1 (kv_aware): wall seconds,
       events (the issue's bound: under 60 s here)
plan   for each rate factor f (the trace's arrival times / f): the planner's pick within 256 GPUs, TP 8 per pool,
       kv_aware and round_robin, SLOs TTFT <= 2 s and TPOT <= 100 ms for 90 % of requests
Writes bench/results/sim_scale.json (and docs/simulator.md's "At scale" block with --docs). The GPU profile is
an estimate (its source says what was measured and what assumed): so are these sizes.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

from bench import history
from bench.experiments import common
from common.mooncake import Scale, load_trace
from sim.cluster import ClusterSpec, simulate
from sim.planner import Goal, Limits, plan, report
from sim.profile import load_profile
from sim.workload import from_trace

NAME = "sim_scale"
TRACE = common.REPO.parent / "shared" / "traces" / "mooncake_conversation_trace.jsonl"
PROFILE = "gpu_h200_llama8b_bf16_estimate"
SLOS = {"ttft": 2000.0, "tpot": 100.0}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.experiments.sim_scale", description=__doc__.splitlines()[0])
    p.add_argument("--trace", default=str(TRACE))
    p.add_argument("--profile", default=PROFILE)
    p.add_argument("--rates", type=float, nargs="+", default=[1.0, 4.0, 16.0, 32.0])
    p.add_argument("--tp", type=int, nargs="+", default=[8])
    p.add_argument("--policies", nargs="+", default=["kv_aware", "round_robin"])
    p.add_argument("--max-gpus", type=int, default=256)
    p.add_argument("--docs", action="store_true")
    return p.parse_args(argv)


def speed(trace, profile) -> list[dict[str, Any]]:
    rows = []
    for p, d, tp in ((16, 16, 8), (128, 128, 1)):
        spec = ClusterSpec(prefill=p, decode=d, prefill_tp=tp, decode_tp=tp, policy="kv_aware", block_tokens=512)
        reqs = from_trace(trace, Scale(512, max_output=1 << 20), slos_ms=SLOS)
        result = simulate(spec, profile, reqs)
        rows.append({"shape": spec.name(), "gpus": spec.gpus, "requests": len(reqs), "wall_s": round(result.wall_s, 2),
                     "events": result.events, "summary": result.summary})
    return rows


def plans(trace, profile, args: argparse.Namespace) -> list[dict[str, Any]]:
    t0 = trace[0].timestamp_ms
    base = [(r.timestamp_ms - t0) / 1000 for r in trace]
    scale = Scale(512, max_output=1 << 20)
    rows = []
    for factor in args.rates:
        def workload(f: float, factor=factor):
            return from_trace(trace, scale, slos_ms=SLOS, offsets=[t / (factor * f) for t in base])

        started = time.perf_counter()
        limits = Limits(args.max_gpus, tuple(args.policies), tuple(args.tp), ClusterSpec(block_tokens=512), rate_factors=(0.5, 1.0, 1.5))
        result = plan(profile, workload, Goal(SLOS), limits)
        body = report(result)
        rows.append({"rate_factor": factor, "rate_req_s": len(trace) / (base[-1] / factor), "chosen": body["chosen"], "why": body["why"],
                     "simulations": body["simulations"], "wall_s": round(time.perf_counter() - started, 1),
                     "candidates": body["candidates"]})
        print(f"x{factor:g}: {body['why']} ({body['simulations']} simulations, {rows[-1]['wall_s']} s)", file=sys.stderr)
    return rows


def markdown(out: dict[str, Any]) -> str:
    lines = [f"Profile `{out['profile']}` (an estimate), trace {out['requests']} requests, SLOs TTFT <= {SLOS['ttft']:g} ms and "
             f"TPOT <= {SLOS['tpot']:g} ms for 90 % of requests, TP {out['tp']} per pool, policies {', '.join(out['policies'])}, "
             f"at most {out['max_gpus']} GPUs. Simulated on {history.machine_name(out['machine'])}, commit {out['machine']['git_commit']}.", "",
             "Speed (the full trace, real times and lengths):", "",
             "| shape | GPUs | wall s | events | TTFT p50 / p99 ms | TPOT p50 / p99 ms | reuse |", "|---|---:|---:|---:|---:|---:|---:|"]
    for r in out["speed"]:
        s = r["summary"]
        lines.append(f"| {r['shape']} | {r['gpus']} | {r['wall_s']} | {r['events']} | {s['ttft_ms']['p50']:.0f} / {s['ttft_ms']['p99']:.0f} | "
                     f"{s['tpot_ms']['p50']:.1f} / {s['tpot_ms']['p99']:.1f} | {s['reuse']:.3f} |")
    lines += ["", "`pdserve plan` per arrival rate (the trace's times / factor):", "",
              "| rate | req/s | pick | GPUs | attainment | goodput req/s | TTFT p50 / p99 ms | ITL p50 / p99 ms | goodput at 0.5x / 1x / 1.5x | simulations (s) |",
              "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in out["plans"]:
        c = r["chosen"]
        if c is None:
            lines.append(f"| x{r['rate_factor']:g} | {r['rate_req_s']:.1f} | none within {out['max_gpus']} GPUs | | | | | | | {r['simulations']} ({r['wall_s']}) |")
            continue
        by = " / ".join(f"{c['goodput_by_rate'][k]['goodput']:.2f}" for k in ("0.5", "1", "1.5") if k in c["goodput_by_rate"])
        lines.append(f"| x{r['rate_factor']:g} | {r['rate_req_s']:.1f} | {c['shape']}, {c['policy']} | {c['gpus']} | {c['attainment']:.3f} | "
                     f"{c['goodput']:.2f} | {c['ttft_p50_ms']:.0f} / {c['ttft_p99_ms']:.0f} | {c['itl_p50_ms']:.1f} / {c['itl_p99_ms']:.1f} | {by} | "
                     f"{r['simulations']} ({r['wall_s']}) |")
    return "\n".join(lines)


def write_doc(text: str) -> None:
    path = common.REPO / "docs" / "simulator.md"
    doc = path.read_text()
    begin, end = "<!-- BEGIN plan_at_scale -->", "<!-- END plan_at_scale -->"
    head, _, rest = doc.partition(begin)
    _, _, tail = rest.partition(end)
    path.write_text(f"{head}{begin}\n{text}\n{end}{tail}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    profile = load_profile(args.profile)
    trace = load_trace(args.trace)
    from common.hardware import cpu_info

    machine = {**cpu_info().record(), "cpus": os.cpu_count(), "git_commit": history.git_commit(), "started_unix": int(time.time())}
    out = {"experiment": NAME, "command": common.command_line(), "profile": profile.path.rpartition("/")[2], "requests": len(trace),
           "tp": args.tp, "policies": args.policies, "max_gpus": args.max_gpus, "machine": machine}
    out["speed"] = speed(trace, profile)
    out["plans"] = plans(trace, profile, args)
    out["markdown"] = markdown(out)
    history.record(common.RESULTS / f"{NAME}.json", json.loads(json.dumps(out, default=str)))
    print(out["markdown"])
    if args.docs:
        write_doc(out["markdown"])
    return 0


if __name__ == "__main__":
    sys.exit(main())

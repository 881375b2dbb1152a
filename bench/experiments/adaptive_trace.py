"""Experiment: a replayed trace whose mix shifts, against fixed P/D splits and the adaptive controller.

    python -m bench.experiments.adaptive_trace [--configs colocated 1p1d 1p2d adaptive] [--phase-s 75] [--quick]

The trace (seeded, the same for every config): four phases of `--phase-s` seconds (`--phases` picks and
orders them), Poisson arrivals, every prompt distinct (no prefix-cache hits):
  prompt_heavy  long prompts, short answers (summaries)
  decode_heavy  short prompts, long answers (chats)
  mixed         half of each kind, interleaved
  long_both     long prompts and long answers (chats over a long context)
Lengths and rates: PHASES, scaled by --scale (lengths) and --load (rates). Each request kind has its
SLOs: TTFT <= --slo-ttft for all; TPOT <= --slo-tpot-interactive for the kinds read as they stream
(chats: the tight one, and the controller's ITL SLO), <= --slo-tpot for the others (summaries are read
when done). Interference is what tells the shapes apart: colocated, every local prompt's chunks stall
the streams on its worker; split, one core prefills every prompt.

Deployment: every config is the real Ray deployment, `pdserve serve -c CONFIG` (deploy.launcher: the
controller actor places the router and one actor per worker), same engine config (one torch thread
per worker, chunked prefill with `--budget` tokens per step), same two cores (the workers are not
pinned: Ray's logical CPUs are bookkeeping, the OS shares the machine's cores between the worker
processes, as it would for any deployment on this box). Ray rather than a hand-made loop over plain
processes because the adaptive run must be the real controller: its monitor tick builds the
`Snapshot`, `AdaptivePolicy.decide()` plans, and the plan is carried out by real role switches of
worker actors and real threshold changes on the router actor; Ray's own processes cost every config
the same. The configs:
  colocated  0 prefill + 2 decode workers; every prompt prefills on its decode worker
  1p1d       1 prefill + 1 decode worker, local-prefill threshold 0 (every prompt disaggregated)
  1p2d       1 prefill + 2 decode workers on the same 2 cores (three processes share them: the
             "1P+2D" shape this machine allows, oversubscribed by one worker)
  adaptive   starts as 1p1d with `autoscaler.adaptive.mode: adaptive`; pools prefill [1, 1] (the
             shipped default keeps one prefill worker), decode [1, 2]: it moves the local-prefill
             threshold and may add a second decode worker (ADAPTIVE: its interval, holds, cooldowns)
  adaptive_p0  the same policy with prefill [0, 1]: it may also switch the prefill worker to decode
  adaptive_c   the same policy and pools as adaptive_p0, started colocated (0 prefill + 2 decode): a
             decode worker becomes prefill only when the signals say a split would serve better

Lifecycle of one config (`run_config`; the deployment: bench/experiments/ray_deployment.py): write its
YAML, start `pdserve serve` and wait for its ready
line; connect to its Ray as a driver and find the controller; send a few warm-up requests; replay the
trace through the router's gRPC Generate (bench.servebench: one stamp per streamed chunk) while a
thread polls the controller's events (`Controller.events_since`) and `CpuShare` counts the CPU time
of the deployment, of this process and of everything else on the machine (a shared machine: other
users' work is recorded, not prevented; the Ray workers run at nice 0, not Ray's 15, so that they
compete for the cores like any process); read the workers' KV blocks once
the trace is done (all must be free again: no block leaked); SIGTERM the serve (it drains and
removes every actor). Each config writes bench/results/adaptive_trace_<config>.json (raw records; another stem
with --results-name, as the simulator's validation does); the summary adaptive_trace.json and .png are rebuilt from every
per-config file of the same trace, so the configs can run one per command (the machine's CPU lock
is taken per command, between configs). Goodput = requests meeting both SLOs (TTFT and TPOT) per
second: per phase, over the requests that arrived in it, divided by the phase's length; overall,
over all of them, divided by the run's duration (first request sent to last finished).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import re
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from bench import serve
from bench.cluster import bench_config
from bench.experiments import common
from bench.experiments.ray_deployment import CpuShare, Deployment, EventPoller, leaked_blocks, replay, settle
from bench.servebench.metrics import meets_slos
from bench.servebench.workload import DEFAULT_VOCAB, RequestSpec, random_ids

NAME = "adaptive_trace"
ROLES = ("prefill", "decode")


@dataclass(frozen=True)
class Kind:
    name: str
    prompt: tuple[int, int]
    output: tuple[int, int]
    interactive: bool
    """Read as it streams (a chat): held to the tight TPOT SLO (--slo-tpot-interactive); otherwise --slo-tpot."""


LONG_PROMPT = Kind("summary", (384, 768), (4, 16), interactive=False)
LONG_ANSWER = Kind("chat", (16, 64), (96, 192), interactive=True)
LONG_BOTH = Kind("long_chat", (1024, 1536), (96, 160), interactive=True)
KINDS = (LONG_PROMPT, LONG_ANSWER, LONG_BOTH)


@dataclass(frozen=True)
class Phase:
    name: str
    rate: float
    """Requests per second."""
    kinds: tuple[tuple[Kind, float], ...]
    """(kind, weight)."""


PHASES = (
    Phase("prompt_heavy", 1.3, ((LONG_PROMPT, 1.0),)),
    Phase("decode_heavy", 1.2, ((LONG_ANSWER, 1.0),)),
    Phase("mixed", 1.0, ((LONG_PROMPT, 0.5), (LONG_ANSWER, 0.5))),
    Phase("long_both", 0.2, ((LONG_BOTH, 1.0),)),
)

CONFIGS = {
    "colocated": {"prefill": 0, "decode": 2, "adaptive": False},
    "1p1d": {"prefill": 1, "decode": 1, "adaptive": False},
    "1p2d": {"prefill": 1, "decode": 2, "adaptive": False},
    "adaptive": {"prefill": 1, "decode": 1, "adaptive": True, "prefill_min": 1},
    "adaptive_p0": {"prefill": 1, "decode": 1, "adaptive": True, "prefill_min": 0},
    "adaptive_c": {"prefill": 0, "decode": 2, "adaptive": True, "prefill_min": 0},
}
FIXED = ("colocated", "1p1d", "1p2d")

ADAPTIVE = {"hold_intervals": 2, "action_cooldown_s": 20, "threshold_cooldown_s": 8, "local_prefill_step": 512,
            "local_prefill_max": 1024, "window_s": 6}
"""The adaptive run's controller settings: a decision every 2 s interval x 2 holds at the soonest."""

# ---- the trace ---------------------------------------------------------------------------------
def build_trace(phases: tuple[Phase, ...], phase_s: float, scale: float, load: float,
                seed: int) -> tuple[list[RequestSpec], list[str], list[Kind]]:
    """The seeded trace: RequestSpecs in arrival order, each one's phase name and its kind."""
    rng = np.random.default_rng(seed)
    specs: list[RequestSpec] = []
    phase_of: list[str] = []
    kind_of: list[Kind] = []
    for p, phase in enumerate(phases):
        t = p * phase_s + rng.exponential(1 / (phase.rate * load))
        weights = np.array([w for _, w in phase.kinds])
        while t < (p + 1) * phase_s:
            kind = phase.kinds[rng.choice(len(phase.kinds), p=weights / weights.sum())][0]
            n_in = max(1, int(rng.integers(kind.prompt[0], kind.prompt[1] + 1) * scale))
            n_out = max(2, int(rng.integers(kind.output[0], kind.output[1] + 1) * scale))
            specs.append(RequestSpec(len(specs), n_in, n_out, float(t), prompt_ids=random_ids(rng, n_in, DEFAULT_VOCAB)))
            phase_of.append(phase.name)
            kind_of.append(kind)
            t += rng.exponential(1 / (phase.rate * load))
    return specs, phase_of, kind_of


def slos_of(kind: Kind, args: argparse.Namespace) -> dict[str, float]:
    """A request's SLOs (ms) by its kind."""
    return {"ttft": args.slo_ttft, "tpot": args.slo_tpot_interactive if kind.interactive else args.slo_tpot}


def trace_id(specs: list[RequestSpec]) -> str:
    """A fingerprint of the trace: configs are compared only on the same one."""
    h = hashlib.sha256()
    for s in specs:
        h.update(f"{s.prompt_len},{s.output_len},{s.arrival_s:.6f},{s.prompt_ids[:4]};".encode())
    return h.hexdigest()[:16]


# ---- one deployment ----------------------------------------------------------------------------
def deploy_config(name: str, args: argparse.Namespace) -> dict[str, Any]:
    """The `pdserve serve` YAML of config `name`: same engine for all, pools and controller per config."""
    shape = CONFIGS[name]
    config = bench_config(args.transport, engine={"max_num_batched_tokens": args.budget, "kv_cache_memory_mb": 512})
    config["router"]["local_prefill_threshold"] = 0
    config["pools"] = {
        "prefill": {"replicas": shape["prefill"], "min_replicas": shape.get("prefill_min", 0),
                    "max_replicas": 1 if shape["adaptive"] else shape["prefill"], "num_cpus": 1},
        "decode": {"replicas": shape["decode"], "min_replicas": 1, "max_replicas": 2 if shape["adaptive"] else shape["decode"],
                   "num_cpus": 1},
    }
    config["autoscaler"] = {"enabled": shape["adaptive"], "interval_s": args.interval, "upscale_cooldown_s": 20,
                            "downscale_cooldown_s": 60, "latency_quantile": 0.9,
                            "prefill": {"ttft_slo_s": args.slo_ttft / 1000}, "decode": {"itl_slo_s": args.slo_tpot_interactive / 1000},
                            "adaptive": {"mode": "adaptive" if shape["adaptive"] else "pools", **ADAPTIVE}}
    return config


def run_config(name: str, specs: list[RequestSpec], phase_of: list[str], kind_of: list[Kind], args: argparse.Namespace) -> dict[str, Any]:
    config = deploy_config(name, args)
    log_dir = Path(args.log_dir) / name
    with Deployment(name, config, log_dir) as deployment, EventPoller(deployment) as poller:
        loadavg_before = common.loadavg()
        cpu = CpuShare(deployment.proc.popen.pid)
        records, duration, t0 = replay(deployment.grpc_address, specs, args.warmup)
        cpu_share = cpu.stop()
        loadavg_after = common.loadavg()
        status = settle(deployment)
    for r in records:
        r["kind"], r["slos_ms"] = kind_of[r["index"]].name, slos_of(kind_of[r["index"]], args)
    slos = {"ttft": args.slo_ttft, "tpot": args.slo_tpot, "tpot_interactive": args.slo_tpot_interactive}
    return {
        "config": name, "shape": CONFIGS[name], "deploy_config": config, "slos_ms": slos,
        "trace": {"id": trace_id(specs), "requests": len(specs), "phase_s": args.phase_s},
        "loadavg": [loadavg_before, loadavg_after], "cpu": cpu_share, "log_dir": str(log_dir),
        "metrics": score(records, phase_of, duration, args.phase_s, slos),
        "events": [timed(e, t0) for e in poller.events],
        "workers_at_end": {role: [w["id"] for w in pool["workers"]] for role, pool in status["pools"].items()},
        "leaked_kv_blocks": leaked_blocks(status),
        "t0_unix": t0, "requests": records,
    }


def timed(event: dict, t0: float) -> dict:
    """An event with its time on the trace's clock (`t_s`: seconds since the trace's first request)."""
    return {"t_s": round(event["time"] - t0, 2), **event}


# ---- scoring -----------------------------------------------------------------------------------
def score(records: list[dict], phase_of: list[str], duration: float, phase_s: float, slos: dict[str, float]) -> dict[str, Any]:
    """Overall and per-phase serving metrics; every request of the trace accounted for."""
    names = list(dict.fromkeys(phase_of))
    out: dict[str, Any] = {"overall": brief(serve.compute_metrics(records, duration, slos))}
    out["overall"]["sent"] = len(records)
    for phase in names:
        mine = [r for r in records if phase_of[r["index"]] == phase]
        out[phase] = brief(serve.compute_metrics(mine, phase_s, slos))
        out[phase]["sent"] = len(mine)
    return out


def brief(m: dict[str, Any]) -> dict[str, Any]:
    keep = ("completed", "failed", "good_requests", "goodput", "request_throughput", "output_throughput", "duration_s")
    pct = ("median", "p99")
    return {**{k: m[k] for k in keep}, **{f"{key}_ms": {p: m[f"{key}_ms"][p] for p in pct} for key in ("ttft", "tpot", "itl")}}


def acceptance(results: dict[str, dict], name: str = "adaptive") -> dict[str, Any] | None:
    """An adaptive config's overall goodput vs the best and the worst fixed config of the same trace."""
    fixed = {n: r["metrics"]["overall"]["goodput"] for n, r in results.items() if n in FIXED}
    if name not in results or not fixed:
        return None
    mine = results[name]["metrics"]["overall"]["goodput"]
    best, worst = max(fixed, key=fixed.get), min(fixed, key=fixed.get)
    return {"adaptive": mine, "best_fixed": best, "best_goodput": fixed[best], "worst_fixed": worst, "worst_goodput": fixed[worst],
            "over_best": mine / fixed[best] if fixed[best] else math.inf, "over_worst": mine / fixed[worst] if fixed[worst] else math.inf,
            "met": mine >= fixed[best] and mine >= 1.2 * fixed[worst]}


# ---- summary and plot --------------------------------------------------------------------------
def load_results(tid: str, stem: str = NAME) -> dict[str, dict]:
    """Every per-config result of trace `tid` found in RESULTS (`<stem>_<config>.json`), by config."""
    found = {}
    for name in CONFIGS:
        path = common.RESULTS / f"{stem}_{name}.json"
        if path.exists():
            data = json.loads(path.read_text())
            if data["trace"]["id"] == tid:
                found[name] = data
    return found


def summarize(results: dict[str, dict], info: dict, args: argparse.Namespace, phases: list[str]) -> dict[str, Any]:
    return {
        "experiment": args.results_name, "command": common.command_line(), "machine": info, "params": vars(args),
        "phases": [asdict(p) for p in PHASES], "phase_names": phases, "adaptive_settings": ADAPTIVE,
        "results": {n: {k: r.get(k) for k in ("shape", "slos_ms", "trace", "loadavg", "cpu", "metrics", "events", "leaked_kv_blocks",
                                          "workers_at_end")} | {"raw": f"{args.results_name}_{n}.json"} for n, r in results.items()},
        "acceptance": acceptance(results),
        "acceptance_by_config": {n: acceptance(results, n) for n in results if CONFIGS[n]["adaptive"]},
    }


def plot(results: dict[str, dict], phases: list[str], phase_s: float, stem: str = NAME) -> str:
    plt = common.pyplot()
    adaptive = [n for n in results if CONFIGS[n]["adaptive"]]
    fig, axes = plt.subplots(1 + len(adaptive), 1, figsize=(13, 4.6 * (1 + len(adaptive))), squeeze=False)
    bars = axes[0][0]
    groups = [*phases, "overall"]
    width = 0.8 / max(1, len(results))
    for i, (name, res) in enumerate(results.items()):
        values = [res["metrics"][g]["goodput"] for g in groups]
        bars.bar(np.arange(len(groups)) + i * width, values, width, label=name)
    bars.set_xticks(np.arange(len(groups)) + width * (len(results) - 1) / 2, groups)
    bars.set_ylabel("goodput (req/s meeting TTFT and TPOT SLOs)")
    bars.set_title("goodput per phase", fontsize=10)
    bars.legend(fontsize=8)
    bars.grid(alpha=0.3, axis="y")
    for row, name in zip(axes[1:], adaptive):
        timeline(row[0], name, results[name], phases, phase_s)
    return common.save_figure(fig, f"{stem}.png")


def timeline(ax, name: str, res: dict, phases: list[str], phase_s: float) -> None:
    """An adaptive run: its goodput per 10 s window, its shape over time, and each controller event at its time."""
    slos = res["slos_ms"]
    ends = [r for r in res["requests"] if r["ok"]]
    good = [r["start_s"] for r in ends if good_request(r, slos)]
    edges = np.arange(0, len(phases) * phase_s + 10, 10)
    counts, _ = np.histogram(good, bins=edges)
    ax.step(edges[:-1], counts / 10, where="post", color="tab:green", label=f"{name} goodput (by arrival, 10 s)")
    for p, phase in enumerate(phases):
        ax.axvspan(p * phase_s, (p + 1) * phase_s, color=f"C{p}", alpha=0.07)
        ax.text((p + 0.5) * phase_s, 0.02, phase, transform=ax.get_xaxis_transform(), ha="center", fontsize=8)
    for k, e in enumerate(e for e in res["events"] if e["t_s"] >= 0):
        ax.axvline(e["t_s"], color="tab:red" if e["pool"] == "controller" else "tab:purple", lw=1, ls="--")
        ax.text(e["t_s"], 0.97 - 0.09 * (k % 8), event_label(e), transform=ax.get_xaxis_transform(), fontsize=6, va="top")
    shape = ax.twinx()
    times, p, d, t = zip(*shape_timeline(res, len(phases) * phase_s))
    shape.step(times, p, where="post", color="tab:blue", label="prefill workers")
    shape.step(times, d, where="post", color="tab:orange", label="decode workers")
    shape.step(times, [x / 512 for x in t], where="post", color="gray", ls=":", label="local-prefill threshold / 512")
    shape.set_ylim(-0.1, max(3, max(d) + 1))
    shape.set_ylabel("workers; threshold / 512 tokens")
    shape.legend(fontsize=7, loc="center right")
    ax.set_ylim(bottom=0)
    ax.set_xlabel("trace time (s)")
    ax.set_ylabel("req/s")
    ax.set_title(f"{name}: the controller's decisions (red: plans, purple: role switches / resizes)", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper left")


def shape_timeline(res: dict, end_s: float) -> list[tuple[float, int, int, int]]:
    """(time, prefill workers, decode workers, threshold) after each event, from the start shape to `end_s`."""
    shape = res["shape"]
    p, d, t = shape["prefill"], shape["decode"], res.get("start_threshold", 0)
    points = [(0.0, p, d, t)]
    for e in res["events"]:
        if e["pool"] == "controller":
            found = re.search(r"local prefill <= (\d+)", e["to"])
            t = int(found.group(1)) if found else t
        elif e.get("worker_id") and e["from"] in ROLES:  # a role switch
            p, d = (p + 1, d - 1) if e["to"] == "prefill" else (p - 1, d + 1)
        elif isinstance(e.get("to"), int) and e["pool"] in ROLES:  # a resize
            p, d = (e["to"], d) if e["pool"] == "prefill" else (p, e["to"])
        points.append((max(0.0, e["t_s"]), p, d, t))
    points.append((end_s, p, d, t))
    return points


def event_label(e: dict) -> str:
    if e["pool"] == "controller":
        return f"{e['to']}"
    return f"{e.get('worker_id', e['pool'])}: {e['from']} -> {e['to']}"


def good_request(r: dict, slos: dict[str, float]) -> bool:
    stats = serve.token_stats(r)
    if stats is None:
        return False
    return meets_slos(stats, r.get("slos_ms") or slos)


# ---- docs/benchmarks/adaptive_trace.md ---------------------------------------------------------
DOC = common.REPO / "docs" / "benchmarks" / "adaptive_trace.md"
BEGIN = "<!-- BEGIN adaptive_trace: generated by `python -m bench.experiments.adaptive_trace --summary-only --docs` -->"
END = "<!-- END adaptive_trace -->"


def markdown(report: dict[str, Any]) -> str:
    """The generated part of the section: machine, command, the per-phase table, the acceptance and the events."""
    from bench.experiments.report import fmt, header

    phases, lines = report["phase_names"], [BEGIN, *header(report)]
    slos = next(iter(report["results"].values()))["slos_ms"]
    interactive = [k.name for k in KINDS if k.interactive]
    tpot = (f"TPOT <= {slos['tpot_interactive']:g} ms for the requests read as they stream ({', '.join(interactive)}), "
            f"<= {slos['tpot']:g} ms for the others" if "tpot_interactive" in slos else f"TPOT <= {slos['tpot']:g} ms")
    lines += [f"SLOs: TTFT <= {slos['ttft']:g} ms and {tpot}. Goodput in req/s (good / sent in brackets).", "",
              "| config | " + " | ".join(phases) + " | overall | TTFT p50 / p99 (ms) | TPOT p50 / p99 (ms) | ITL p50 / p99 (ms) "
              "| cores: deployment / others |",
              "|---|" + "---:|" * (len(phases) + 1) + "---:|---:|---:|---:|"]
    for name, res in report["results"].items():
        m = res["metrics"]
        cells = [f"{fmt(m[g]['goodput'], 3)} ({m[g]['good_requests']}/{m[g]['sent']})" for g in [*phases, "overall"]]
        o = m["overall"]
        pct = [f"{fmt(o[k]['median'], 0)} / {fmt(o[k]['p99'], 0)}" for k in ("ttft_ms", "tpot_ms", "itl_ms")]
        cpu = res.get("cpu") or {}
        pct.append(f"{fmt(cpu.get('deployment_cores'), 2)} / {fmt(cpu.get('other_processes_cores'), 2)}")
        lines.append(f"| {name} | " + " | ".join(cells + pct) + " |")
    for name, a in ((n, a) for n, a in (report.get("acceptance_by_config") or {}).items() if a):
        lines += ["", f"`{name}` overall goodput {a['adaptive']:.3f} req/s: x{a['over_best']:.2f} the best fixed config "
                  f"({a['best_fixed']}, {a['best_goodput']:.3f}) and x{a['over_worst']:.2f} the worst ({a['worst_fixed']}, "
                  f"{a['worst_goodput']:.3f}); acceptance (>= best and >= 1.2 x worst): {'met' if a['met'] else 'NOT met'}."]
    for name in (n for n in report["results"] if CONFIGS[n]["adaptive"]):
        lines += ["", f"The `{name}` run's events (trace time, `pool`, shape before -> after: reason):", ""]
        lines += [f"- {e['t_s']:.1f} s `{e['pool']}` {e.get('from')} -> {e.get('to')}: {e['reason']}"
                  for e in report["results"][name]["events"] if e["t_s"] >= 0] or ["- none"]
    lines += ["", "![adaptive trace](../../bench/results/adaptive_trace.png)", END]
    return "\n".join(lines)


def write_doc(section: str) -> None:
    """Replaces the generated block in docs/benchmarks/adaptive_trace.md (appends it, the first time)."""
    common.replace_doc_block(DOC, BEGIN, END, section)


# ---- CLI ---------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = common.parser(__doc__, NAME)
    p.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=list(CONFIGS))
    p.add_argument("--phases", nargs="+", choices=[ph.name for ph in PHASES], default=[ph.name for ph in PHASES],
                   help="the phases of the trace, in this order")
    p.add_argument("--phase-s", type=float, default=60.0, help="seconds per phase")
    p.add_argument("--scale", type=float, default=1.0, help="scales every prompt and answer length")
    p.add_argument("--load", type=float, default=1.0, help="scales every phase's request rate")
    p.add_argument("--slo-ttft", type=float, default=6000.0, help="TTFT SLO (ms)")
    p.add_argument("--slo-tpot", type=float, default=250.0, help="TPOT SLO (ms) of the requests read when they are done")
    p.add_argument("--slo-tpot-interactive", type=float, default=35.0,
                   help="TPOT SLO (ms) of the requests read as they stream (chats); the controller's ITL SLO")
    p.add_argument("--budget", type=int, default=512, help="max_num_batched_tokens (chunked prefill)")
    p.add_argument("--interval", type=float, default=2.0, help="autoscaler.interval_s of the adaptive run")
    p.add_argument("--transport", default="tcp", choices=["tcp", "ucx"])
    p.add_argument("--warmup", type=int, default=4, help="warm-up requests before the trace")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-dir", default="/tmp/pdserve-adaptive-trace", help="YAML configs and serve logs")
    p.add_argument("--summary-only", action="store_true", help="rebuild the summary and plot from the per-config files")
    p.add_argument("--docs", action="store_true", help="rewrite the generated block of docs/benchmarks/adaptive_trace.md from the summary")
    p.add_argument("--quick", action="store_true", help="three 12 s phases, short lengths (results under bench/results/quick/)")
    p.add_argument("--results-name", default=NAME, help="stem of the result files (<stem>.json, <stem>_<config>.json): "
                   "the simulator's validation keeps its runs apart from the adaptive benchmark's judged ones")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.quick:
        args.phase_s, args.scale, args.load = 12.0, 0.25, 0.6
    info, started = common.begin(args.quick)
    chosen = tuple(next(ph for ph in PHASES if ph.name == name) for name in args.phases)
    specs, phase_of, kind_of = build_trace(chosen, args.phase_s, args.scale, args.load, args.seed)
    phases = list(dict.fromkeys(phase_of))
    for name in [] if args.summary_only else args.configs:
        result = run_config(name, specs, phase_of, kind_of, args)
        result["machine"] = common.finish(dict(info), started)
        common.save(f"{args.results_name}_{name}", result, history=False)
        overall = result["metrics"]["overall"]
        print(f"{name}: goodput {overall['goodput']:.3f} req/s ({overall['good_requests']}/{overall['sent']} good, "
              f"{overall['failed']} failed), {len(result['events'])} events", file=sys.stderr)
    results = load_results(trace_id(specs), args.results_name)
    if not results:
        return 1
    report = summarize(results, common.finish(info, started), args, phases)
    report["plot"] = plot(results, phases, args.phase_s, args.results_name)
    common.save(args.results_name, report)
    if args.docs and not args.quick:
        write_doc(markdown(report))
    if report["acceptance"]:
        print("acceptance:", json.dumps(report["acceptance"]), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Experiment: the cluster simulator against real runs on this machine (issue #47, item 3).

    python -m bench.experiments.sim_validation [--quick] [--from-results] [--profile P] [--docs]

Two workloads, each run for real and simulated with a profile measured on the run's machine kind (sim/profiles/,
`pdserve profile`; its numbers come from the engine alone, nothing is fitted to these runs):
  trace     the scaled Mooncake conversation trace through bench/experiments/trace_replay.py (real
            router, the run's prefill + decode workers) in three shapes (TRACE_SHAPES): 1P+2D with every setup
            the simulator models (round_robin, prefix_aware, kv_aware, kv_aware+tier; not router.kv_pull),
            1P+1D and colocated (0P+2D) with kv_aware at the 1P+2D run's rate
  adaptive  the shifting trace of bench/experiments/adaptive_trace.py (the real Ray deployment):
            colocated (0P+2D), 1p1d, 1p2d, kept as bench/results/sim_validation_adaptive_<config>.json
Each case gets its own profile: the shipped measured one (sim/profiles, estimates excluded) whose CPU kind
and dtype are the run's (`comparable`; an engine dtype `auto` is what the run's CPU resolves it to);
`--profile` overrides that for every case. A case no shipped profile matches is simulated with the
closest one (same CPU kind, else the default) and shown as not comparable, with the reason.
The simulated cluster is the real one's shape and settings (workers, policy, token budget, max_num_seqs,
KV blocks per worker, tier blocks = the tier's budget / the profile's bytes per block, the tcp link, the two
cores: the trace replay's workers pinned one core each as bench/cluster.py pins them, the Ray deployment's
unpinned; a round_robin trace run's decode order read back from its workers' counters), fed the very
requests the real run sent (arrival offsets, prompt and answer lengths; for the trace, the prompt's hash
ids, so the caches see the same reuse). Each row also carries the per-request stages (decode admission,
prefill queue and compute, KV transfer, TTFT) real vs simulated. Compared: TTFT p50/p99, ITL p50/p99 (every
gap between streamed tokens) and
goodput (common/slo.py; the runs' own SLOs, per request for the adaptive trace), as relative errors
(simulated / measured - 1), against the issue's bounds: 15 % on p50s and goodput, 25 % on p99s. Also the
simulator's pick among each workload's three shapes (highest goodput; the trace's under kv_aware) against the real
runs' pick.

--from-results compares with this command's last runs in bench/results (sim_validation_trace[_<shape>].json,
sim_validation_adaptive_<config>.json; --workloads reruns one of them; their commit and load are in their files: the
comparison is only as good as those runs); --quick runs both experiments small (adaptive --quick,
trace 24 requests) and writes bench/results/quick/sim_validation.json; without either, the experiments run at
their defaults (the trace at TRACE_LOAD; about 33 minutes on a quiet 2-core machine: trace replay of four configurations ~12 min
and of two more shapes ~7, three adaptive deployments ~4.3 min each with start-up) and the table goes to
bench/results/sim_validation.json (and docs/simulator.md with --docs).
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from bench import history
from bench.experiments import common
from bench.servebench.metrics import compute_metrics
from common.config import KVTransferConfig
from common.engine_config import KVTierConfig
from common.mooncake import Scale, load_trace, select_window
from sim.cluster import ClusterSpec, simulate
from sim.profile import SHIPPED, Profile, load_profile
from sim.router import POLICIES
from sim.workload import SimRequest, chain_keys

NAME = "sim_validation"
DEFAULT_PROFILE = "cpu_epyc_avx2_smollm2_fp32"
"""The profile a case with no matching shipped one (and no CPU-kind match either) is simulated with."""
TRACE_CONFIGS = ("round_robin", "prefix_aware", "kv_aware", "kv_aware+tier")
"""The trace replay's setups (bench/trace/setups.py) the simulator models: run for real by this command."""
TRACE_LOAD = 0.65
"""The share of the calibrated rate the trace is offered (the replay's own default is 0.8): its calibration, 16
requests sent at once, overstates what the cluster sustains by up to ~20 % run to run (2.47-2.89 req/s for the same
requests and shape), and at 0.8 x 2.89 the single prefill worker fell behind for the whole replay (TTFT p50 3.4-12 s,
growing with time): a queue that only grows says how far the rates differ, not whether the stages are right."""
TRACE_SHAPES = {"1p2d": (1, 2, TRACE_CONFIGS), "1p1d": (1, 1, ("kv_aware",)), "colocated": (0, 2, ("kv_aware",))}
"""The trace's shapes (prefill workers, decode workers, setups): 1P+2D with every setup the simulator models, then
1P+1D and colocated (0P+2D) with kv_aware, offered the 1P+2D run's rate, so that the simulator's pick among the three
shapes can be set against the real runs' as on the adaptive trace."""
STAGES = ("decode_admission_s", "prefill_queue_s", "prefill_compute_s", "kv_transfer_s", "ttft_s")
ADAPTIVE_CONFIGS = {"colocated": (0, 2), "1p1d": (1, 1), "1p2d": (1, 2)}
ADAPTIVE_RESULTS = "sim_validation_adaptive"
"""The stem of this command's adaptive runs (bench/results/<stem>_<config>.json): apart from the adaptive benchmark's
own runs (adaptive_trace_<config>.json), whose fixed shapes are judged beside its adaptive configs of the same session."""
BOUNDS = {"ttft_p50": 0.15, "itl_p50": 0.15, "goodput": 0.15, "ttft_p99": 0.25, "itl_p99": 0.25}
CORES = 2
TRACE_PINNED = True
"""The trace replay's workers are pinned one core each, round robin, prefill workers first (bench/cluster.py
BenchCluster, PDSERVE_BENCH_PIN unset): with 2 prefill + 2 decode on 2 cores, prefill i and decode i share core i.
The adaptive trace's Ray workers are not pinned (bench/experiments/adaptive_trace.py): any worker, any core."""
MAX_NUM_SEQS = 64  # bench/cluster.py bench_config's engine


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.experiments.sim_validation", description=__doc__.splitlines()[0])
    p.add_argument("--profile", default=None, help="one profile for every case (default: per case, the shipped one of the run's CPU and dtype)")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--from-results", action="store_true", help="compare with the runs already in bench/results (no real run)")
    p.add_argument("--workloads", nargs="+", choices=["trace", "adaptive"], default=["trace", "adaptive"])
    p.add_argument("--docs", action="store_true", help="rewrite the generated block of docs/simulator.md")
    return p.parse_args(argv)


# ---- real runs ---------------------------------------------------------------------------------
def run_real(args: argparse.Namespace, results: Path) -> None:
    from bench.experiments import adaptive_trace, trace_replay

    if "trace" in args.workloads:
        extra = ["--requests", "24"] if args.quick else []
        rate = None
        for shape, (prefill, decode, configs) in TRACE_SHAPES.items():
            pace = ["--rate", str(rate)] if rate else ["--load", str(TRACE_LOAD)]
            path = trace_path(results, shape)
            trace_replay.main(["--configs", *configs, "--prefill", str(prefill), "--decode", str(decode), *pace, *extra, "--out", str(path)])
            rate = rate or json.loads(path.read_text())["trace"]["time"]["rate"]
    if "adaptive" in args.workloads:
        adaptive_trace.main(["--configs", *ADAPTIVE_CONFIGS, "--results-name", ADAPTIVE_RESULTS, *(["--quick"] if args.quick else [])])


def trace_path(results: Path, shape: str) -> Path:
    """Where the trace run of `shape` is kept (the 1P+2D one under its historical name)."""
    return results / ("sim_validation_trace.json" if shape == "1p2d" else f"sim_validation_trace_{shape}.json")


def real_metrics(records: list[dict], slos: dict[str, float]) -> dict[str, Any]:
    sent = [r for r in records if r.get("sent", True)]
    duration = max(r["end_s"] for r in sent) - min(r["start_s"] for r in sent)
    m = compute_metrics(sent, duration, slos)
    return {"ttft_p50": m["ttft_ms"]["p50"], "ttft_p99": m["ttft_ms"]["p99"], "itl_p50": m["itl_ms"]["p50"], "itl_p99": m["itl_ms"]["p99"],
            "goodput": m["goodput"], "completed": m["completed"], "requests": len(sent)}


def sim_metrics(summary: dict[str, Any]) -> dict[str, Any]:
    return {"ttft_p50": summary["ttft_ms"]["p50"], "ttft_p99": summary["ttft_ms"]["p99"], "itl_p50": summary["itl_ms"]["p50"],
            "itl_p99": summary["itl_ms"]["p99"], "goodput": summary["goodput"], "completed": summary["completed"],
            "requests": summary["requests"]}


# ---- cases: (name, spec, requests, real records, slos) -------------------------------------------
def unsupported(setup: dict[str, Any]) -> str | None:
    """Why the simulator cannot run a trace replay setup ({"policy", "overrides"}), or None."""
    if setup.get("policy") not in POLICIES:
        return f"the simulator has no {setup.get('policy')!r} policy"
    overrides = setup.get("overrides") or {}
    if (overrides.get("router") or {}).get("kv_pull"):
        return "the simulator does not model KV pulls between workers (router.kv_pull)"
    engine = {k: v for k, v in (overrides.get("engine") or {}).items() if k != "kv_tier"}
    rest = {k: v for k, v in overrides.items() if k not in ("engine", "router")}
    router = {k: v for k, v in (overrides.get("router") or {}).items() if k != "kv_pull"}
    tier = (overrides.get("engine") or {}).get("kv_tier")
    if engine or rest or router:
        return f"the simulator does not model these overrides: {json.dumps({**rest, 'engine': engine, 'router': router})}"
    if tier and tier.get("kind", "memory") != "memory":
        return f"the simulator models a memory tier only (this one is {tier.get('kind')!r})"
    return None


def round_robin_decode_order(records: list[dict], workers: dict[str, dict], decode: int) -> tuple[int, ...] | None:
    """The real router's decode pool order in a round_robin run (it lists workers as they registered, which the
    run does not record), read back from the run: the i-th request routed goes to position i mod D, and each
    decode worker's generation_tokens counter is the answers it decoded (less their first token, sampled by the
    prefill worker; the router's 1 % shadow recomputes add a few). The order whose positions' sums are nearest
    the counters; None when the counters are missing."""
    counters = [workers.get(f"decode{i}", {}).get("generation_tokens") for i in range(decode)]
    if decode < 2 or any(c is None for c in counters):
        return None
    by_position = [0] * decode
    for i, rec in enumerate(sorted(records, key=lambda r: r["scheduled_s"])):
        by_position[i % decode] += max(0, rec["max_tokens"] - 1)
    return min(itertools.permutations(range(decode)), key=lambda order: sum(abs(counters[w] - by_position[pos]) for pos, w in enumerate(order)))


def trace_cases(path: Path, requests_path: Path, configs: tuple[str, ...] = TRACE_CONFIGS) -> tuple[list[dict[str, Any]], dict[str, str]]:
    """The run's setups among `configs` as cases, and {setup: why not} for the ones it ran that cannot be simulated."""
    run = json.loads(path.read_text())
    raw = json.loads(requests_path.read_text())
    params, window = run["params"], run["trace"]["window"]
    trace = select_window(load_trace(run["trace"]["path"]), window["start_s"], window["end_s"], window["requests"], window["seed"])
    scale = Scale(params["tokens_per_block"], params["output_scale"], max_output=params["max_output"])
    slos = {"ttft": params["slo_ttft"], "tpot": params["slo_tpot"]}
    base = run["cluster"]["base_config"]
    cases, skipped = [], {}
    for name, result in run["results"].items():
        if result.get("status") != "ran" or name not in raw:
            continue
        setup = result.get("setup") or {"policy": name, "overrides": {}}
        why = unsupported(setup)
        if why or name not in configs:
            skipped[name] = why or "not among this command's configs"
            continue
        records = raw[name]
        reqs = []
        for rec in records:
            t = trace[rec["index"]]
            if scale.prompt_len(t) != rec["prompt_len"]:
                raise ValueError(f"{requests_path}: request {rec['index']} is not the window's (prompt {rec['prompt_len']} tokens, "
                                 f"window {scale.prompt_len(t)})")
            reqs.append((rec["scheduled_s"], rec["prompt_len"], rec["max_tokens"], chain_keys(t.hash_ids, rec["prompt_len"] // 16)))
        tier = ((setup.get("overrides") or {}).get("engine") or {}).get("kv_tier") or {}
        decode_order = round_robin_decode_order(records, result.get("workers") or {}, params["decode"]) if setup["policy"] == "round_robin" else None
        spec = ClusterSpec(prefill=params["prefill"], decode=params["decode"], policy=setup["policy"], max_num_batched_tokens=params["budget"],
                           max_num_seqs=base["engine"].get("max_num_seqs", MAX_NUM_SEQS), kv_blocks=run["cluster"]["kv_blocks_per_worker"],
                           cores=CORES, pinned=TRACE_PINNED, transport=params["transport"], block_tokens=params["tokens_per_block"],
                           pool_order=(tuple(range(params["prefill"])), decode_order) if decode_order else None,
                           max_queued_requests=base["router"].get("max_queued_requests", 512),
                           local_prefill_threshold=base["router"].get("local_prefill_threshold", 0),
                           layerwise=streamed_layerwise(base["kv_transfer"]))
        cases.append({"workload": "trace", "config": name, "spec": spec, "requests": reqs, "records": records, "slos": slos,
                      "tier_mb": tier.get("budget_mb", KVTierConfig().budget_mb) if tier else 0,
                      "real_commit": run["machine"].get("git_commit"), "real_loadavg": result.get("loadavg"), "machine": run["machine"],
                      "dtype": base["engine"].get("dtype")})
    return cases, skipped


def adaptive_cases(results: Path) -> list[dict[str, Any]]:
    cases = []
    for name, (p, d) in ADAPTIVE_CONFIGS.items():
        path = results / f"{ADAPTIVE_RESULTS}_{name}.json"
        if not path.exists():
            continue
        run = json.loads(path.read_text())
        engine = run["deploy_config"]["engine"]
        spec = ClusterSpec(prefill=p, decode=d, policy=run["deploy_config"]["router"].get("policy", "round_robin"),
                           max_num_batched_tokens=engine["max_num_batched_tokens"], max_num_seqs=engine.get("max_num_seqs", MAX_NUM_SEQS),
                           cores=CORES, transport=run["deploy_config"]["kv_transfer"]["transport"], block_tokens=16,
                           max_queued_requests=run["deploy_config"]["router"].get("max_queued_requests", 512),
                           layerwise=streamed_layerwise(run["deploy_config"]["kv_transfer"]))
        records = run["requests"]
        reqs = [(r["scheduled_s"], r["prompt_len"], r["max_tokens"], None, r.get("slos_ms")) for r in records]
        cases.append({"workload": "adaptive", "config": name, "spec": spec, "requests": reqs, "records": records,
                      "kv_cache_mb": engine["kv_cache_memory_mb"],
                      "slos": {"ttft": run["slos_ms"]["ttft"], "tpot": run["slos_ms"]["tpot"]},
                      "real_commit": run["machine"].get("git_commit"), "real_loadavg": run.get("loadavg"), "trace_id": run["trace"]["id"],
                      "machine": run["machine"], "dtype": engine.get("dtype")})
    ids = {c["trace_id"] for c in cases}
    if len(ids) > 1:
        raise ValueError(f"the adaptive runs in {results} are of different traces ({sorted(ids)}): rerun them together")
    return cases


def streamed_layerwise(kv_transfer: dict[str, Any]) -> bool:
    """Whether the run's CPU prefill workers streamed KV layer by layer (its `kv_transfer` section; unset: by device)."""
    return KVTransferConfig(layerwise=kv_transfer.get("layerwise")).streams_layerwise("cpu")


def sim_requests(case: dict[str, Any]) -> list[SimRequest]:
    out = []
    for i, row in enumerate(case["requests"]):
        arrival, prompt, output, keys = row[:4]
        slos = row[4] if len(row) > 4 and row[4] else case["slos"]
        keys = keys if keys is not None else tuple(hash((7, (1 << 41) + i, b)) for b in range(prompt // 16))
        out.append(SimRequest(i, arrival, prompt, output, keys, slos))
    return out


# ---- comparison --------------------------------------------------------------------------------
def comparable(machine: dict[str, Any], dtype: str, profile) -> str | None:
    """Why a run cannot be judged by this profile (another CPU kind or dtype), or None."""
    mine = profile.machine
    if sorted(machine.get("cpu_features") or []) != sorted(mine.get("cpu_features") or []) or machine.get("cpu") != mine.get("cpu"):
        return f"the run's CPU ({machine.get('cpu')}, {machine.get('cpu_features')}) is not the profile's ({mine.get('cpu')}, {mine.get('cpu_features')})"
    resolved = machine.get("cpu_auto_dtype") if dtype in (None, "auto") else dtype
    if resolved != profile.dtype:
        return f"the run's dtype ({resolved}) is not the profile's ({profile.dtype})"
    return None


def shipped_profiles() -> list[Profile]:
    """The measured profiles shipped in sim/profiles (estimates are not of any machine here)."""
    profiles = [load_profile(path) for path in sorted(SHIPPED.glob("*.json"))]
    return [p for p in profiles if not p.estimate]


def profile_for(case: dict[str, Any], profiles: list[Profile]) -> Profile:
    """The profile of the run's CPU kind and dtype; without one, the closest (same CPU kind, else the default),
    which `compare` marks not comparable."""
    for profile in profiles:
        if comparable(case["machine"], case["dtype"], profile) is None:
            return profile
    for profile in profiles:
        if "CPU" not in (comparable(case["machine"], case["dtype"], profile) or ""):
            return profile
    return next((p for p in profiles if Path(p.path).stem == DEFAULT_PROFILE), None) or load_profile(DEFAULT_PROFILE)


def spec_for(case: dict[str, Any], profile: Profile) -> ClusterSpec:
    """The case's cluster with the sizes that depend on the dtype's bytes per block: the KV pool when the run
    states megabytes, not blocks, and the tier's blocks (engine/kv_tier.py: budget // bytes per block)."""
    block_bytes = profile.kv_bytes_per_token * (case["spec"].block_tokens or profile.block_size)
    changes: dict[str, Any] = {}
    if case.get("kv_cache_mb"):
        changes["kv_blocks"] = (case["kv_cache_mb"] << 20) // block_bytes
    if case.get("tier_mb"):
        changes["tier_blocks"] = max(1, (case["tier_mb"] << 20) // block_bytes)
    return replace(case["spec"], **changes)


def stage_summary(real: list[dict], simulated: list[dict]) -> dict[str, Any]:
    """Per-request stages, real (the router's critical path, `server_timings`) vs simulated: mean and p50 in ms."""
    def stats(values: list[float]) -> dict[str, float] | None:
        return {"mean": round(float(np.mean(values)) * 1000, 1), "p50": round(float(np.median(values)) * 1000, 1)} if values else None

    out = {}
    for stage in STAGES:
        real_values = [r["server_timings"].get(stage, 0.0) for r in real if r.get("server_timings")]
        sim_values = [s[stage] for s in simulated if s.get(stage) is not None]
        out[stage] = {"real": stats(real_values), "sim": stats(sim_values)}
    return out


def compare(case: dict[str, Any], profile: Profile) -> dict[str, Any]:
    real = real_metrics(case["records"], case["slos"])
    spec = spec_for(case, profile)
    requests = sim_requests(case)
    result = simulate(spec, profile, requests)
    simulated = sim_metrics(result.summary)
    errors = {k: (simulated[k] / real[k] - 1 if real[k] and simulated[k] is not None else None) for k in BOUNDS}
    within = {k: (e is not None and abs(e) <= BOUNDS[k]) for k, e in errors.items()}
    sent = [r for r in case["records"] if r.get("sent", True)]
    return {"workload": case["workload"], "config": case["config"], "shape": spec.name(), "policy": spec.policy,
            "profile": Path(profile.path).name, "kv_blocks": spec.kv_blocks, "tier_blocks": spec.tier_blocks,
            "real": real, "sim": simulated, "errors": errors, "within": within, "all_within": all(within.values()),
            "stages_ms": stage_summary(sent, [{**r.stage_s, "ttft_s": r.ttft} for r in requests]),
            "real_commit": case["real_commit"], "real_loadavg": case["real_loadavg"], "sim_wall_s": round(result.wall_s, 3),
            "not_comparable": comparable(case["machine"], case["dtype"], profile)}


def pick(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The shape with the highest goodput among `rows` (one per shape), real and simulated; None with fewer than two."""
    rows = [r for r in rows if not r["not_comparable"]]
    if len(rows) < 2:
        return None
    real = max(rows, key=lambda r: r["real"]["goodput"])["config"]
    sim = max(rows, key=lambda r: r["sim"]["goodput"])["config"]
    ties = [r["config"] for r in rows if r["real"]["goodput"] == max(x["real"]["goodput"] for x in rows)]
    return {"real_best": real, "sim_best": sim, "same": real == sim, "real_ties": ties if len(ties) > 1 else [],
            "goodput": {r["config"]: {"real": r["real"]["goodput"], "sim": r["sim"]["goodput"]} for r in rows}}


def picks(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per workload, the best of its three shapes: the adaptive trace's, and the conversation trace's under kv_aware."""
    return {"adaptive": pick([r for r in rows if r["workload"] == "adaptive"]),
            "trace": pick([r for r in rows if r["workload"] == "trace" and r["config"].endswith(" kv_aware")])}


def markdown(report: dict[str, Any]) -> str:
    def pct(e):
        return "-" if e is None else f"{e:+.0%}"

    how = "--profile, every case" if report.get("profile_override") else "per case: the run's CPU kind and dtype"
    lines = [f"Profiles: {', '.join(f'`{p}`' for p in report['profiles'])} ({how}); real runs: {report['source']}.", "",
             "| workload | config | profile | TTFT p50 real / sim (err) | TTFT p99 | ITL p50 | ITL p99 | goodput real / sim (err) | within bounds |",
             "|---|---|---|---:|---:|---:|---:|---:|---|"]
    for r in report["rows"]:
        cells = []
        for k in ("ttft_p50", "ttft_p99", "itl_p50", "itl_p99"):
            real, sim = r["real"][k], r["sim"][k]
            cells.append(f"{real:.0f} / {sim:.0f} ({pct(r['errors'][k])})" if real is not None and sim is not None else "-")
        g = f"{r['real']['goodput']:.3f} / {r['sim']['goodput']:.3f} ({pct(r['errors']['goodput'])})"
        ok = "yes" if r["all_within"] else "no: " + ", ".join(k for k, v in r["within"].items() if not v)
        if r["not_comparable"]:
            ok = f"not comparable: {r['not_comparable']}"
        lines.append(f"| {r['workload']} | {r['config']} | {Path(r['profile']).stem} | {' | '.join(cells)} | {g} | {ok} |")
    for name, why in (report.get("skipped") or {}).items():
        lines.append(f"\nNot simulated: trace {name}: {why}.")
    for workload, p in (report.get("picks") or {}).items():
        if p:
            lines += ["", f"Best of the {workload} workload's shapes by goodput: real {p['real_best']}, simulated {p['sim_best']} "
                          f"({'the same' if p['same'] else 'different'})"
                          + (f"; the real runs tie ({', '.join(p['real_ties'])}): no pick to match." if p.get("real_ties") else ".")]
    return "\n".join(lines)


def write_doc(text: str) -> None:
    path = common.REPO / "docs" / "simulator.md"
    doc = path.read_text()
    begin, end = "<!-- BEGIN sim_validation -->", "<!-- END sim_validation -->"
    head, _, rest = doc.partition(begin)
    _, _, tail = rest.partition(end)
    path.write_text(f"{head}{begin}\n{text}\n{end}{tail}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.time()
    fixed = load_profile(args.profile) if args.profile else None
    profiles = shipped_profiles()
    results = common.RESULTS / "quick" if args.quick else common.RESULTS
    if not args.from_results:
        run_real(args, results)
    cases, skipped = [], {}
    if "trace" in args.workloads:
        for shape in TRACE_SHAPES:
            path = trace_path(results, shape)
            if path.exists():
                found, why = trace_cases(path, path.with_name(path.stem + "_requests.json"))
                cases += [{**case, "config": f"{shape} {case['config']}"} for case in found]
                skipped |= {f"{shape} {name}": reason for name, reason in why.items()}
    if "adaptive" in args.workloads:
        cases += adaptive_cases(results)
    rows = [compare(c, fixed or profile_for(c, profiles)) for c in cases]
    report = {"experiment": NAME, "command": common.command_line(), "machine": common.finish(common.machine(), started),
              "profiles": sorted({r["profile"] for r in rows}), "profile_override": args.profile, "bounds": BOUNDS,
              "source": "the runs already in bench/results (--from-results)" if args.from_results else "run by this command",
              "rows": rows, "skipped": skipped, "picks": picks(rows),
              "all_within": all(r["all_within"] for r in rows if not r["not_comparable"]) if rows else False}
    report["markdown"] = markdown(report)
    out = history.record(results / f"{NAME}.json", json.loads(json.dumps(report, default=str)))
    print(report["markdown"])
    print(f"\n{out}", file=sys.stderr)
    if args.docs and not args.quick:
        write_doc(report["markdown"])
    return 0


if __name__ == "__main__":
    sys.exit(main())

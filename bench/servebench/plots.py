"""PNG plots of a serving report: latency CDFs, an ITL timeline per run (bursts shaded), goodput
against request rate."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np

from bench.servebench.records import streamed, token_stats


def plot_report(report: dict[str, Any], stem: Path) -> list[str]:
    """Latency CDFs, an ITL timeline per run (bursts shaded), goodput against rate. Returns paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    runs = report["runs"]
    fig, axes = plt.subplots(2, 2, figsize=(10, 7))
    for ax, key, title in zip(axes.flat, ("ttft", "tpot", "itl", "e2e"), ("TTFT", "TPOT", "ITL", "E2E latency")):
        for run in runs:
            values = []
            for rec in run["requests"]:
                s = token_stats(rec)
                if s is None:
                    continue
                if key == "itl":
                    values.extend(s["itl"])
                elif s[key] is not None:
                    values.append(s[key])
            if values:
                xs = np.sort(np.asarray(values) * 1000.0)
                ys = np.arange(1, len(xs) + 1) / len(xs)
                ax.step(np.r_[xs[0], xs], np.r_[0.0, ys], where="post", label=run["label"])
        ax.set_title(title)
        ax.set_xlabel("ms")
        ax.set_ylabel("fraction of requests" if key != "itl" else "fraction of gaps")
        ax.grid(alpha=0.3)
        if key in ("itl", "e2e"):
            ax.set_xscale("log")
    axes.flat[0].legend(fontsize=8)
    fig.tight_layout()
    paths.append(_save(fig, stem.with_name(stem.name + "_cdf.png")))

    fig, axes = plt.subplots(len(runs), 1, figsize=(10, 2.6 * len(runs)), squeeze=False)
    for ax, run in zip(axes[:, 0], runs):
        plot_itl_timeline(ax, run["requests"], run.get("burst_itl", {}).get("windows", []))
        ax.set_title(f"ITL timeline: {run['label']}", fontsize=9)
    fig.tight_layout()
    paths.append(_save(fig, stem.with_name(stem.name + "_itl_timeline.png")))

    if len(runs) > 1 and report.get("slos_ms"):
        rated = [r for r in runs if r["request_rate"] is not None and not math.isinf(r["request_rate"])]
        if len(rated) > 1:
            fig, ax = plt.subplots(figsize=(6, 4))
            xs = [r["request_rate"] for r in rated]
            ax.plot(xs, [r["metrics"]["goodput"] for r in rated], "o-", label="goodput")
            ax.plot(xs, [r["metrics"]["request_throughput"] for r in rated], "s--", label="throughput")
            ax.plot(xs, xs, ":", color="gray", label="offered")
            ax.set_xlabel("request rate (req/s)")
            ax.set_ylabel("req/s")
            ax.set_title("goodput " + " ".join(f"{k}<={v:g}ms" for k, v in report["slos_ms"].items()), fontsize=9)
            ax.grid(alpha=0.3)
            ax.legend()
            fig.tight_layout()
            paths.append(_save(fig, stem.with_name(stem.name + "_goodput.png")))
    plt.close("all")
    return paths


def plot_itl_timeline(ax, records: list[dict], windows: list[dict]) -> None:
    """Every ITL gap of main requests at its end time; burst windows shaded."""
    xs, ys = [], []
    for rec in records:
        if rec["group"] != "main" or not streamed(rec):
            continue
        times = rec["chunk_times_s"]
        xs.extend(times[1:])
        ys.extend((b - a) * 1000.0 for a, b in zip(times, times[1:]))
    ax.scatter(xs, ys, s=3, alpha=0.5)
    for w in windows:
        ax.axvspan(w["start_s"], w["end_s"], color="tab:red", alpha=0.15, label="burst" if w is windows[0] else None)
    if windows:
        ax.legend(fontsize=8, loc="upper right")
    ax.set_xlabel("time since start (s)")
    ax.set_ylabel("ITL (ms)")
    if ys and max(ys) > 20 * max(min(ys), 1e-3):
        ax.set_yscale("log")
    ax.grid(alpha=0.3)


def _save(fig, path: Path) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    return str(path)

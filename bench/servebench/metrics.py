"""vLLM's serving metrics (TTFT, TPOT, ITL, E2E, throughput, goodput) computed from the raw stamps of
the records, and the ITL of the main requests inside and outside burst windows."""

from __future__ import annotations

import argparse
from typing import Any

import numpy as np

from bench.servebench.records import CANCELLED, streamed, token_stats
from common.slo import meets_slos  # one definition, shared with sim/

DEFAULT_PERCENTILES = (50.0, 90.0, 99.0)
SLO_KEYS = {"ttft": "ttft", "tpot": "tpot", "e2el": "e2el", "e2e": "e2el"}


def summarize(values_s: list[float], percentiles=DEFAULT_PERCENTILES) -> dict[str, float | int | None]:
    """mean/median/std/min/max and percentiles, in milliseconds (None when there is no value)."""
    out: dict[str, float | int | None] = {"count": len(values_s)}
    keys = ["mean", "median", "std", "min", "max"] + [f"p{p:g}" for p in percentiles]
    if not values_s:
        return {**out, **{k: None for k in keys}}
    ms = np.asarray(values_s, dtype=float) * 1000.0
    out.update(mean=float(ms.mean()), median=float(np.median(ms)), std=float(ms.std()), min=float(ms.min()), max=float(ms.max()))
    for p in percentiles:
        out[f"p{p:g}"] = float(np.percentile(ms, p))
    return out


def compute_metrics(records: list[dict], duration_s: float, slos_ms: dict[str, float] | None = None,
                    percentiles=DEFAULT_PERCENTILES) -> dict[str, Any]:
    """vLLM's serving metrics over `records` (dicts as saved in the JSON)."""
    ttfts, tpots, itls, e2es, good = [], [], [], [], 0
    completed = input_tokens = output_tokens = 0
    for rec in records:
        s = token_stats(rec)
        if s is None:
            continue
        completed += 1
        input_tokens += rec["prompt_tokens"] if rec["prompt_tokens"] is not None else rec["prompt_len"]
        output_tokens += rec["output_tokens"]
        ttfts.append(s["ttft"])
        e2es.append(s["e2e"])
        itls.extend(s["itl"])
        if s["tpot"] is not None:
            tpots.append(s["tpot"])
        if slos_ms:  # a record may carry its own (its request's class)
            good += meets_slos(s, rec.get("slos_ms") or slos_ms)
    per_s = (lambda x: x / duration_s) if duration_s > 0 else (lambda x: 0.0)
    cancelled = sum(1 for r in records if r.get("finish_reason") == CANCELLED)
    return {
        "completed": completed,
        "failed": len(records) - completed - cancelled,
        "cancelled": cancelled,
        "duration_s": duration_s,
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": per_s(completed),
        "output_throughput": per_s(output_tokens),
        "total_token_throughput": per_s(input_tokens + output_tokens),
        "goodput": per_s(good) if slos_ms else None,
        "good_requests": good if slos_ms else None,
        "slos_ms": slos_ms or None,
        "ttft_ms": summarize(ttfts, percentiles),
        "tpot_ms": summarize(tpots, percentiles),
        "itl_ms": summarize(itls, percentiles),
        "e2el_ms": summarize(e2es, percentiles),
    }


def burst_windows(records: list[dict]) -> list[dict[str, float]]:
    """Per burst: from its requests' first send to the last of their first tokens (the prefill
    work the burst brings); a burst request that failed ends the window at its end."""
    windows: dict[int, list[float]] = {}
    for rec in records:
        if rec["group"] != "burst":
            continue
        end = rec["chunk_times_s"][0] if rec["chunk_times_s"] else rec["end_s"]
        w = windows.setdefault(rec["burst"], [rec["start_s"], end])
        w[0], w[1] = min(w[0], rec["start_s"]), max(w[1], end)
    return [{"burst": b, "start_s": s, "end_s": e} for b, (s, e) in sorted(windows.items())]


def burst_itl(records: list[dict], windows: list[dict[str, float]], percentiles=DEFAULT_PERCENTILES) -> dict[str, Any]:
    """ITL of the main (non-burst) requests, split by burst window.

    inside:  gaps that overlap a burst window (a < end and b > start);
    outside: the other gaps, from `steady_from_s` on = when every main request sent before the
             first burst had its first token (so start-up prefills don't count as steady state);
             also split into `before` (ending before the first window) and `after` (starting after
             the last window), since a burst can leave the server slower than it found it."""
    if not windows:
        return {}
    first_burst = min(w["start_s"] for w in windows)
    last_burst = max(w["end_s"] for w in windows)
    steady_from = max((r["chunk_times_s"][0] for r in records
                       if r["group"] == "main" and streamed(r) and r["chunk_times_s"] and r["start_s"] < first_burst), default=0.0)
    inside, outside, before, after = [], [], [], []
    for rec in records:
        if rec["group"] != "main" or not streamed(rec):
            continue
        times = rec["chunk_times_s"]
        for a, b in zip(times, times[1:]):
            if any(a < w["end_s"] and b > w["start_s"] for w in windows):
                inside.append(b - a)
            elif a >= steady_from:
                outside.append(b - a)
                if b <= first_burst:
                    before.append(b - a)
                elif a >= last_burst:
                    after.append(b - a)
    out = {"steady_from_s": steady_from, "windows": windows,
           "inside_ms": summarize(inside, percentiles), "outside_ms": summarize(outside, percentiles),
           "before_ms": summarize(before, percentiles), "after_ms": summarize(after, percentiles)}
    top = f"p{max(percentiles):g}"
    if out["inside_ms"][top] is not None and out["outside_ms"][top]:
        out[f"{top}_ratio"] = out["inside_ms"][top] / out["outside_ms"][top]
    if out["inside_ms"][top] is not None and out["before_ms"][top]:
        out[f"{top}_ratio_vs_before"] = out["inside_ms"][top] / out["before_ms"][top]
    return out


def parse_slos(items: list[str] | None) -> dict[str, float]:
    slos: dict[str, float] = {}
    for item in items or []:
        key, _, value = item.partition(":")
        if key not in SLO_KEYS or not value:
            raise argparse.ArgumentTypeError(f"--goodput takes KEY:MS with KEY in ttft, tpot, e2el; got {item!r}")
        slos[SLO_KEYS[key]] = float(value)
    return slos

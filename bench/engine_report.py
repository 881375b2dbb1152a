"""What `bench.engine` shows of its record: the text summary (stdout) and the plot (engine.png), one
part per dtype. Reads only the record `bench.engine.run_dtypes` returns."""

from __future__ import annotations

from pathlib import Path

SYSTEMS = (("engine", "pdserve engine"), ("hf_static", "HF static"), ("hf_continuous", "HF continuous"))


def summary(record: dict) -> str:
    m = record["machine"]
    lines = [f"CPU {m['cpu']} (features {', '.join(m['cpu_features']) or 'none'}; auto dtype {m['cpu_auto_dtype']})"]
    for dtype, r in record["by_dtype"].items():
        lines += [f"== {dtype}", *_dtype_lines(r)]
    return "\n".join(lines)


def _dtype_lines(r: dict) -> list[str]:
    c = r["workload_ceiling"]
    lines = [
        f"engine            {r['engine']['tokens_per_s']:9.1f} tok/s",
        f"hf static         {r['hf_static']['tokens_per_s']:9.1f} tok/s",
        f"hf continuous     {r['hf_continuous']['tokens_per_s']:9.1f} tok/s",
        f"bound             {c['useful_tokens_per_s']:9.1f} tok/s (attention-free; at most {c['max_possible_over_hf_static']:.1f}x hf static, "
        f"{c['max_possible_over_hf_continuous']:.1f}x hf continuous)",
        f"bound + KV read   {c.get('bound_with_kv_read_tokens_per_s', float('nan')):9.1f} tok/s (the bound plus reading each decode step's KV "
        f"once at {r.get('memory_ceiling', {}).get('gb_per_s', float('nan'))} GB/s)",
        f"engine decode b{r['engine_decode']['batch']:<3}{r['engine_decode']['tokens_per_s']:9.1f} tok/s",
        f"matmul ceiling    {r['matmul_ceiling']['tokens_per_s']:9.1f} tok/s (decode batch {r['matmul_ceiling']['batch']})",
        f"prefill ceiling   {r['prefill_ceiling']['tokens_per_s']:9.1f} tok/s (prompt tokens, {r['prefill_ceiling']['tokens']}-token chunk)",
    ]
    for name, value in r["ratios"].items():
        target = r["targets"].get(name)
        verdict = f"target >= {target['target']}: {'met' if target['met'] else 'NOT met'}; " if target else ""
        lines.append(f"{name:32s} {value:7.3f}  ({verdict}per CPU-second {r['ratios_cpu_time'][name]:.3f})")
    lines.append(r["load"]["load_note"])
    return lines


def plot(record: dict, path: Path) -> Path:
    """Left: useful tok/s of each system and the bound, grouped by dtype. Right: the engine's fraction
    of the bound and decode at the largest batch over its ceiling, per dtype."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    dtypes = list(record["by_dtype"])
    runs = [record["by_dtype"][d] for d in dtypes]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2), gridspec_kw={"width_ratios": [3, 2]})
    width = 0.8 / (len(SYSTEMS) + 1)
    bars = [(label, [r[key]["tokens_per_s"] for r in runs]) for key, label in SYSTEMS]
    bars.append(("attention-free bound", [r["workload_ceiling"]["useful_tokens_per_s"] for r in runs]))
    for k, (label, values) in enumerate(bars):
        xs = [i + (k - len(bars) / 2 + 0.5) * width for i in range(len(dtypes))]
        left.bar(xs, values, width, label=label, hatch="//" if k == len(bars) - 1 else None)
        for x, v in zip(xs, values):
            left.annotate(f"{v:.0f}", (x, v), ha="center", va="bottom", fontsize=8)
    _axis(left, dtypes, "useful output tokens/s")
    left.legend(fontsize=8)
    fractions = (("engine_over_bound", "engine / bound"), ("engine_decode_b64_over_ceiling", "decode / ceiling"))
    for k, (key, label) in enumerate(fractions):
        xs = [i + (k - 0.5) * 0.35 for i in range(len(dtypes))]
        values = [r["ratios"][key] for r in runs]
        right.bar(xs, values, 0.35, label=label)
        for x, v in zip(xs, values):
            right.annotate(f"{v:.2f}", (x, v), ha="center", va="bottom", fontsize=8)
    _axis(right, dtypes, "fraction of the attention-free ceiling")
    right.set_ylim(0, 1.05)
    right.legend(fontsize=8)
    fig.suptitle(f"engine benchmark on {record['machine']['cpu']}, {record['settings']['num_requests']} requests", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _axis(ax, dtypes: list[str], ylabel: str) -> None:
    ax.set_xticks(range(len(dtypes)), dtypes)
    ax.set_ylabel(ylabel)
    ax.grid(axis="y", alpha=0.3)

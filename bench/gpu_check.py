"""The GPU device check: issue 14's five measurements in one run, one JSON and one text summary.

Usage: `python -m bench.gpu_check --out DIR [--quick] [--device cuda|cpu]` (scripts/gpu_check.sh
wraps it for the device machine). Sections, each under its own time budget, each written to
DIR/gpu_check.json the moment it ends (a crash or a timeout keeps the rest):
  1 correctness         SmolLM2-shaped random model: fp32 greedy == HF generate token for token, bf16 share
  2 engine_throughput   ~1B Llama-shaped random model in bf16, 256 mixed requests through the engine,
    hf_static           transformers `generate` in static batches (a subset: the rate is per useful token),
    hf_continuous       transformers' own continuous batching
  3 decode_step         batch 1 / 32 / 128: graph replay, runner and full engine step vs the HBM bound
  4 kv_transfer         KV blocks between two processes through CUDA IPC vs device memcpy; host staging
  5 disaggregated       router + prefill + decode processes, a burst of streaming greedy requests
DIR/gpu_check.txt holds the summary against the issue's acceptance targets.
"""

from __future__ import annotations

import argparse
import json
import sys

from bench import history
from bench.gpu import sections
from bench.gpu.device import describe, has_cuda
from bench.gpu.disagg import section_disaggregated
from bench.gpu.harness import Report, log, out_dir
from bench.gpu.settings import CheckSettings, quick

TARGETS = {"engine_over_hf_static": 5.0, "engine_over_hf_continuous": 1.5, "decode_b128_fraction_of_bound": 0.5, "kv_ipc_over_memcpy": 0.25}


SECTIONS = ("correctness", "engine_throughput", "hf_static", "hf_continuous", "decode_step", "kv_transfer", "disaggregated")


def run(s: CheckSettings, out: str | None, only: tuple[str, ...] = SECTIONS) -> Report:
    folder = out_dir(out)
    report = Report(folder / "gpu_check.json", {"machine": describe(s.device), "settings": s.__dict__, "targets": TARGETS})
    log(f"gpu check on {s.device} (quick={s.quick}): {report.data['machine']}")
    m = sections.Models(s)
    runners = {
        "correctness": lambda: sections.section_correctness(s),
        "engine_throughput": lambda: sections.section_engine_throughput(m),
        "hf_static": lambda: sections.section_hf_static(m),
        "hf_continuous": lambda: sections.section_hf_continuous(m),
        "decode_step": lambda: sections.section_decode_step(m),
        "kv_transfer": lambda: sections.section_kv_transfer(m),
        "disaggregated": lambda: section_disaggregated(s),
    }
    for name in SECTIONS:
        if name in only:
            report.section(name, s.budget(name), runners[name])
    report.put("summary", summarize(report.data["sections"]))
    history.append(report.path, report.data, "gpu_check")
    (folder / "gpu_check.txt").write_text(summary_text(report.data))
    log(f"wrote {report.path} and {folder / 'gpu_check.txt'}")
    return report


def _get(sections_: dict, *path):
    node = sections_
    for key in path:
        if not isinstance(node, dict) or key not in node:
            return None
        node = node[key]
    return node


def _ratio(a, b) -> float | None:
    return round(a / b, 2) if a and b else None


def summarize(sec: dict) -> dict:
    engine = _get(sec, "engine_throughput", "tokens_per_s")
    batches = _get(sec, "decode_step", "batches") or {}
    largest = max(batches, key=int) if batches else None
    return {
        "fp32_identical": _get(sec, "correctness", "fp32_identical"),
        "bf16_identical_share": _get(sec, "correctness", "bfloat16", "identical_share"),
        "engine_tokens_per_s": engine,
        "engine_decode_kernel": _get(sec, "engine_throughput", "decode_kernel"),
        "engine_graph_decode_steps": _get(sec, "engine_throughput", "decode_steps_from_cuda_graphs"),
        "engine_fallback_reason": _get(sec, "engine_throughput", "fallback_reason"),
        "engine_over_hf_static": _ratio(engine, _get(sec, "hf_static", "tokens_per_s")),
        "engine_over_hf_continuous": _ratio(engine, _get(sec, "hf_continuous", "tokens_per_s")),
        "decode_largest_batch": largest,
        "decode_fraction_of_bound": _get(batches, largest, "fraction_of_bound") if largest else None,
        "kv_ipc_over_memcpy": _get(sec, "kv_transfer", "ipc_contiguous_over_memcpy"),
        "kv_ipc_gather_over_memcpy": _get(sec, "kv_transfer", "ipc_gather_over_memcpy"),
        "disaggregated_all_equal": _get(sec, "disaggregated", "all_equal"),
        "disaggregated_ttft_ms_median": _get(sec, "disaggregated", "ttft_ms", "median"),
        "disaggregated_itl_ms_median": _get(sec, "disaggregated", "itl_ms", "median"),
        "section_status": {k: v.get("status") for k, v in sec.items()},
    }


def summary_text(data: dict) -> str:
    m, s = data["machine"], data["summary"]
    lines = [f"pdserve GPU check on {m.get('gpu', m.get('cpu'))} (torch {m['torch']}, transformers {m['transformers']})"]
    lines += [f"  {k}: {v}" for k, v in s.items() if k != "decode_fraction_of_bound"]
    for name, frac in (s.get("decode_fraction_of_bound") or {}).items():
        lines.append(f"  decode batch {s['decode_largest_batch']} {name}: {frac} of the HBM bound")
    for name, sec in data["sections"].items():
        if sec.get("status") in ("error", "timeout"):
            lines.append(f"  {name} FAILED: {sec.get('error')}")
    lines.append("targets: " + json.dumps(TARGETS))
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.gpu_check", description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=None, help="folder for gpu_check.json/.txt (default $OUT, else ./gpu_out)")
    parser.add_argument("--quick", action="store_true", help="tiny sizes (minutes on a CPU): how the check is tested")
    parser.add_argument("--device", choices=("cuda", "cpu"), default=None, help="default: cuda when available")
    parser.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated subset of {','.join(SECTIONS)}")
    args = parser.parse_args(argv)
    only = tuple(x for x in args.sections.split(",") if x)
    unknown = [x for x in only if x not in SECTIONS]
    if unknown:
        parser.error(f"--sections: unknown {unknown}; known: {', '.join(SECTIONS)}")
    device = args.device or ("cuda" if has_cuda() else "cpu")
    if device == "cuda" and not has_cuda():
        parser.error("--device cuda: torch sees no CUDA device")
    settings = quick(device) if args.quick else CheckSettings(device=device)
    report = run(settings, args.out, only)
    sys.stderr.write(summary_text(report.data))
    return 0


if __name__ == "__main__":
    sys.exit(main())

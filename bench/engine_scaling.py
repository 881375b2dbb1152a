"""Per-thread scaling of the engine: the engine benchmark's workload through `engine.Engine` at 1 and N threads.

Usage: `pdserve bench engine --scaling [--scaling-threads 1,2] [--scaling-rounds 2] [--baseline-rev REV] [--dtype ...]`
(bench/engine.py: `--scaling` runs this instead of the whole engine benchmark, into bench/results/engine_scaling.json).

Lifecycle: `run_scaling` exports the workload once (bench.peers.offline.export_workload: seed 0, 64 requests), then for
each dtype runs rounds of one process per thread count (bench/peers/pdserve_offline.py: model load and one warm-up
request untimed, then every request added at once and stepped until done: output tokens / wall seconds), the thread
counts interleaved within a round so that a neighbour's burst hits every count alike. With `baseline_rev`, the same
runs of that revision (a git worktree of it, removed at the end) alternate with this checkout's in every round: a
change's before/after in the same minutes. Each run records how busy the rest of the machine was meanwhile (bench.measure, less the run's own process).
Per revision and dtype the best round counts (the least disturbed by neighbours on a shared VM; every round is kept),
`scaling` is tok/s at the most threads over tok/s at 1 thread, and `speedup` this checkout over the baseline.
"""

from __future__ import annotations

import json
import logging
import os
import resource
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from bench.engine_workload import Settings
from bench.measure import Machine
from bench.peers.offline import export_workload

log = logging.getLogger("bench.engine_scaling")
REPO = Path(__file__).resolve().parent.parent
CURRENT = "current"
BASELINE = "baseline"


def run_scaling(s: Settings, model_dir: str, threads: tuple[int, ...] = (1, 2), rounds: int = 2, baseline_rev: str | None = None) -> dict[str, Any]:
    """One record: per dtype, every run and the per-revision summary (`summarize`)."""
    with tempfile.TemporaryDirectory(prefix="pdserve-scaling-") as tmp, _checkouts(baseline_rev, Path(tmp)) as checkouts:
        workload = Path(tmp) / "workload.json"
        export_workload(s, model_dir, workload)
        by_dtype = {}
        for dtype in s.dtypes:
            runs = []
            for round_ in range(rounds):
                for n in threads:
                    for name, repo in checkouts.items():
                        runs.append({"round": round_, "revision": name, **run_one(repo, workload, Path(tmp), dtype, n)})
            by_dtype[dtype] = {"runs": runs, **summarize(runs, threads, list(checkouts))}
    return {"threads": list(threads), "rounds": rounds, "baseline_rev": baseline_rev,
            "revisions": {name: _commit(rev) for name, rev in ((CURRENT, "HEAD"), (BASELINE, baseline_rev)) if rev}, "by_dtype": by_dtype}


def run_one(repo: Path, workload: Path, workdir: Path, dtype: str, threads: int) -> dict[str, Any]:
    """bench.peers.pdserve_offline of the checkout at `repo` in its own process: its figures and the machine's load."""
    result = workdir / f"run_{dtype}_{threads}t.json"
    argv = [sys.executable, "-m", "bench.peers.pdserve_offline", str(workload), str(result), "--dtype", dtype, "--threads", str(threads)]
    machine = Machine()
    children0 = _children_cpu_seconds()
    with machine.phase("run"):
        done = subprocess.run(argv, cwd=repo, env={**os.environ, "HF_HUB_OFFLINE": "1"}, capture_output=True, text=True)
    child_cores = (_children_cpu_seconds() - children0) / machine.phases["run"]["wall_s"]
    if done.returncode != 0:
        raise RuntimeError(f"engine run at {repo} ({dtype}, {threads} threads) failed:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
    record = json.loads(result.read_text())
    load = machine.phases["run"]
    other = None if load["other_processes_cpu_cores"] is None else round(max(0.0, load["other_processes_cpu_cores"] - child_cores), 2)
    log.info("%s %s %dt: %.1f tok/s (other processes: %s cores)", repo, dtype, threads, record["tokens_per_s"], other)
    return {"threads": threads, "tokens_per_s": record["tokens_per_s"], "wall_s": record["wall_s"], "cpu_s": record["cpu_s"],
            "cpu_cores_used": round(record["cpu_s"] / record["wall_s"], 2), "output_token_ids": record["output_token_ids"],
            "loadavg_1m_start": load["loadavg_1m_start"], "other_processes_cpu_cores": other}


def summarize(runs: list[dict[str, Any]], threads: tuple[int, ...], revisions: list[str]) -> dict[str, Any]:
    """Best tok/s per revision and thread count, each revision's scaling (most threads / 1), this checkout's speedup over
    the baseline per thread count, and whether every run produced the same tokens (greedy: they must). Drops the runs'
    token ids once compared."""
    best = {rev: {n: max(r["tokens_per_s"] for r in runs if r["revision"] == rev and r["threads"] == n) for n in threads} for rev in revisions}
    top, one = max(threads), min(threads)
    out: dict[str, Any] = {
        "best_tokens_per_s": {rev: {str(n): v for n, v in b.items()} for rev, b in best.items()},
        "scaling": {rev: round(b[top] / b[one], 3) for rev, b in best.items()},
    }
    if BASELINE in best:
        out["speedup"] = {str(n): round(best[CURRENT][n] / best[BASELINE][n], 3) for n in threads}
    tokens = [r.pop("output_token_ids") for r in runs]
    out["identical_outputs"] = all(t == tokens[0] for t in tokens)
    return out


def _children_cpu_seconds() -> float:
    """CPU seconds of this process's waited-for children (the run's process: bench.measure counts only this one's own)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


@contextmanager
def _checkouts(baseline_rev: str | None, tmp: Path) -> Iterator[dict[str, Path]]:
    """This checkout, and a detached worktree of `baseline_rev` when asked (removed on the way out)."""
    if baseline_rev is None:
        yield {CURRENT: REPO}
        return
    tree = tmp / "baseline"
    subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(tree), baseline_rev], check=True, capture_output=True)
    try:
        yield {CURRENT: REPO, BASELINE: tree}
    finally:
        subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(tree)], capture_output=True)


def _commit(rev: str) -> str:
    done = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", rev], capture_output=True, text=True)
    return done.stdout.strip() or rev


def summary(report: dict[str, Any]) -> str:
    lines = []
    for dtype, d in report["by_dtype"].items():
        for rev, best in d["best_tokens_per_s"].items():
            figures = ", ".join(f"{n}t {v:.1f}" for n, v in best.items())
            lines.append(f"{dtype} {rev} ({report['revisions'].get(rev, '')}): {figures} tok/s, scaling {d['scaling'][rev]:.2f}x")
        if "speedup" in d:
            lines.append(f"{dtype} speedup over baseline: " + ", ".join(f"{n}t {v:.2f}x" for n, v in d["speedup"].items()))
        lines.append(f"{dtype} identical outputs across runs: {d['identical_outputs']}")
    return "\n".join(lines)



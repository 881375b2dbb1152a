"""Shared bits of the experiments: where results go, what the machine looked like, JSON output."""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import shlex
import sys
import time
from pathlib import Path
from typing import Any

from bench.history import git_commit, record
from common.hardware import cpu_info

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "bench" / "results"
log = logging.getLogger("bench.experiments")


def use_quick_results() -> None:
    """--quick runs write into bench/results/quick/ (git-ignored), never over the real results."""
    global RESULTS
    RESULTS = REPO / "bench" / "results" / "quick"
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / ".gitignore").write_text("*\n")


def parser(module_doc: str, name: str) -> argparse.ArgumentParser:
    """The CLI of `python -m bench.experiments.<name>`, described by its module docstring's first line."""
    return argparse.ArgumentParser(prog=f"python -m bench.experiments.{name}", description=module_doc.splitlines()[0])


def begin(quick: bool) -> tuple[dict[str, Any], float]:
    """Start of a run: --quick results kept apart, logging on; returns (the machine as found, start time)."""
    if quick:
        use_quick_results()
    setup_logging()
    started = time.time()
    return machine(), started


def pyplot():
    """matplotlib.pyplot, drawing to files only."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def style_axes(axes, xlabel: str, ylabel: str | None = None) -> None:
    """The experiments' plot style: labels, a light grid, a small legend."""
    for ax in axes:
        ax.set_xlabel(xlabel)
        if ylabel is not None:
            ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)


def save_figure(fig, filename: str) -> str:
    """Lays out `fig`, writes it to RESULTS/filename, closes it and returns the path relative to the
    repository (what the results' JSON records: the same on every checkout)."""
    fig.tight_layout()
    path = RESULTS / filename
    fig.savefig(path, dpi=110)
    pyplot().close(fig)
    return str(path.relative_to(REPO)) if path.is_relative_to(REPO) else str(path)


def setup_logging() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")


def loadavg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def machine() -> dict[str, Any]:
    """Where and when: CPUs, model name, versions, the load average (other work on the box)."""
    import torch

    info: dict[str, Any] = {
        "cpus": os.cpu_count(),
        **cpu_info().record(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "loadavg_start": loadavg(),
        "started_unix": int(time.time()),
        "git_commit": git_commit(),
    }
    return info


def finish(info: dict[str, Any], started: float) -> dict[str, Any]:
    info["loadavg_end"] = loadavg()
    info["duration_s"] = round(time.time() - started, 1)
    return info


def command_line() -> str:
    module = sys.modules["__main__"].__spec__.name if getattr(sys.modules["__main__"], "__spec__", None) else sys.argv[0]
    return " ".join(["python", "-m", module, *map(shlex.quote, sys.argv[1:])])


def save(name: str, report: dict[str, Any], history: bool = True) -> Path:
    """RESULTS/name.json, and the run's line in RESULTS/history.jsonl (bench.history); `history=False` for a
    part of a run (one config's raw records) whose summary is saved too."""
    path = RESULTS / f"{name}.json"
    if history:
        return record(path, report, name)
    RESULTS.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1) + "\n")
    log.info("wrote %s", path)
    return path


def replace_doc_block(doc: Path, begin: str, end: str, section: str) -> None:
    """Replace the generated block between `begin` and `end` in `doc` with `section` (appended, the first time)."""
    text = doc.read_text()
    if begin in text and end in text:
        text = text[: text.index(begin)] + section + text[text.index(end) + len(end):]
    else:
        text = text.rstrip("\n") + "\n\n" + section + "\n"
    doc.write_text(text)

"""Regenerate every serving experiment, then their page docs/benchmarks/serving.md.

    python -m bench.experiments.all [--quick] [--only NAME ...] [--no-docs]

Runs each experiment as its own process, one after the other (they start and stop their own
router/worker processes), writes bench/results/all.json (exit codes, durations, load averages)
and renders docs/benchmarks/serving.md from the JSON results (bench.experiments.report).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

from bench.experiments import common, report

EXPERIMENTS = tuple(experiment for _, experiment, _ in report.SECTIONS)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.experiments.all", description=__doc__.splitlines()[0])
    p.add_argument("--only", nargs="+", choices=EXPERIMENTS, default=list(EXPERIMENTS))
    p.add_argument("--quick", action="store_true", help="each experiment's small smoke run, into bench/results/quick/ (docs untouched)")
    p.add_argument("--no-docs", action="store_true", help="do not rewrite docs/benchmarks.md")
    args = p.parse_args(argv)
    common.setup_logging()
    summary = {"started_unix": int(time.time()), "loadavg_start": common.loadavg(), "experiments": {}}
    failed = []
    for name in args.only:
        cmd = [sys.executable, "-m", f"bench.experiments.{name}", *(["--quick"] if args.quick else [])]
        common.log.info("running %s", " ".join(cmd[1:]))
        started = time.time()
        rc = subprocess.run(cmd, cwd=common.REPO).returncode
        summary["experiments"][name] = {"rc": rc, "duration_s": round(time.time() - started, 1), "loadavg_after": common.loadavg()}
        if rc:
            failed.append(name)
    summary["loadavg_end"] = common.loadavg()
    if args.quick:
        common.use_quick_results()
    common.RESULTS.mkdir(parents=True, exist_ok=True)
    (common.RESULTS / "all.json").write_text(json.dumps(summary, indent=1) + "\n")
    if not (args.no_docs or args.quick):  # smoke numbers never go into the docs
        report.main([])
    if failed:
        common.log.error("failed: %s", ", ".join(failed))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

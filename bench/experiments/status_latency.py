"""Experiment: how long `pdserve status` takes on a local deployment, and what the router process holds.

    python -m bench.experiments.status_latency [--prefill 1] [--decode 2] [--runs 5] [--quick]

Starts `pdserve serve` (embedded Ray, the demo model, `--prefill` + `--decode` workers), waits until
every worker is healthy, then runs `pdserve status` `--runs` times as an operator does (a fresh
process each time) and, as the baseline in the same run, as many times through Ray (joining the
cluster as a driver, the path `status` takes when the controller's loopback endpoint is not found
here: deploy/status_endpoint.py; both name the deployment's Ray address), recording each one's wall time and CPU time (user + system of the
child). It also reads the router actor's RSS and whether it mapped libtorch (/proc/PID/maps).
Writes bench/results/status_latency.json (with --quick: bench/results/quick/).
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from bench.cluster import REPO, start_process, stop_process
from bench.experiments import common
from deploy.status_endpoint import endpoint_file

RAY_PATH = ("import sys; import deploy.commands as c; c.fetch_status = lambda *a, **k: None; "
            "from deploy.cli import main; sys.exit(main(sys.argv[1:]))")


def deployment_config(prefill: int, decode: int) -> dict[str, Any]:
    pool = {"min_replicas": 1, "num_cpus": 0.5}
    return {"kv_transfer": {"transport": "tcp"}, "router": {"grpc_port": 0, "http_port": 0},
            "pools": {"prefill": {**pool, "replicas": prefill, "max_replicas": prefill},
                      "decode": {**pool, "replicas": decode, "max_replicas": decode}}}


def timed(cmd: list[str]) -> dict[str, Any]:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300, check=False)
    wall = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr[-3000:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {"wall_s": wall, "cpu_s": cpu, "report": json.loads(done.stdout)}


def healthy_workers(report: dict) -> int:
    return sum(w["health"] == "healthy" for pool in report["pools"].values() for w in pool["workers"])


def actor_processes(name: str) -> list[int]:
    """Pids of the Ray actor processes whose title starts with `ray::<name>`."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if (entry / "cmdline").read_bytes().startswith(f"ray::{name}".encode()):
                    pids.append(int(entry.name))
            except OSError:
                continue
    return pids


def process_memory(pid: int) -> dict[str, Any]:
    status = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
    maps = Path(f"/proc/{pid}/maps").read_text()
    return {"pid": pid, "rss_mb": round(int(status["VmRSS"].split()[0]) / 1024, 1), "libtorch_mapped": "libtorch" in maps}


def measure(serve_address: str, runs: int) -> dict[str, Any]:
    fast = [sys.executable, "-m", "deploy.cli", "status", "--json", "--address", serve_address]
    via_ray = [sys.executable, "-c", RAY_PATH, "status", "--json", "--address", serve_address]
    timings: dict[str, list[dict]] = {"endpoint": [], "ray": []}
    for _ in range(runs):  # interleaved: both see the same machine load
        for name, cmd in (("endpoint", fast), ("ray", via_ray)):
            run = timed(cmd)
            run["healthy_workers"] = healthy_workers(run.pop("report"))
            timings[name].append(run)
    summary = {name: {"wall_median_s": statistics.median(r["wall_s"] for r in rs), "cpu_median_s": statistics.median(r["cpu_s"] for r in rs),
                      "wall_max_s": max(r["wall_s"] for r in rs)} for name, rs in timings.items()}
    return {"runs": timings, "summary": summary, "endpoint_file_found": endpoint_file(serve_address).exists(),
            "speedup_wall": summary["ray"]["wall_median_s"] / summary["endpoint"]["wall_median_s"]}


def wait_healthy(expected: int, timeout_s: float = 300.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        done = subprocess.run([sys.executable, "-m", "deploy.cli", "status", "--json"], cwd=REPO, capture_output=True, text=True,
                              timeout=120, check=False)
        if done.returncode == 0 and healthy_workers(json.loads(done.stdout)) == expected:
            return
        time.sleep(2)
    raise RuntimeError(f"{expected} workers were not healthy within {timeout_s:.0f} s")


def main(argv: list[str] | None = None) -> int:
    p = common.parser(__doc__, "status_latency")
    p.add_argument("--prefill", type=int, default=1)
    p.add_argument("--decode", type=int, default=2)
    p.add_argument("--runs", type=int, default=5, help="per path")
    p.add_argument("--quick", action="store_true", help="1 prefill + 1 decode worker, 2 runs per path")
    args = p.parse_args(argv)
    if args.quick:
        args.prefill, args.decode, args.runs = 1, 1, 2
    info, started = common.begin(args.quick)
    workdir = Path(os.environ.get("TMPDIR", "/tmp")) / f"pdserve-status-{os.getpid()}"
    workdir.mkdir(parents=True, exist_ok=True)
    config = workdir / "deployment.yaml"
    config.write_text(yaml.safe_dump(deployment_config(args.prefill, args.decode)))
    serve = start_process("pdserve-serve", ["-m", "deploy.cli", "serve", "-c", str(config)], timeout=600)
    try:
        wait_healthy(args.prefill + args.decode)
        results = measure(serve.ready["ray_address"], args.runs)
        results["router"] = [process_memory(pid) for pid in actor_processes("RouterActor")]
        results["workers"] = [process_memory(pid) for pid in actor_processes("WorkerActor")]
    finally:
        stop_process(serve, timeout=120)
    report = {"experiment": "status_latency", "command": common.command_line(), "machine": info, "params": vars(args),
              "deployment": f"pdserve serve: embedded Ray, {args.prefill} prefill + {args.decode} decode workers, smollm2-135m, tcp KV",
              "results": results}
    common.finish(info, started)
    path = common.save("status_latency", report)
    s = results["summary"]
    print(f"pdserve status: endpoint {s['endpoint']['wall_median_s']:.2f} s wall ({s['endpoint']['cpu_median_s']:.2f} s CPU), "
          f"through Ray {s['ray']['wall_median_s']:.2f} s ({s['ray']['cpu_median_s']:.2f} s CPU); router actor "
          f"{[r['rss_mb'] for r in results['router']]} MB RSS, libtorch mapped: {[r['libtorch_mapped'] for r in results['router']]}; "
          f"{path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

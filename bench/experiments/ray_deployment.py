"""A benchmark's real Ray deployment: `pdserve serve` in its own process, the controller reached as a Ray driver.

Lifecycle: `Deployment(name, config, log_dir)` as a context manager writes the config, starts `pdserve
serve` and waits for its ready line, then joins its Ray and finds the controller; leaving it drops the
driver connection and SIGTERMs the serve (it drains and removes every actor). While it runs:
`EventPoller` collects the controller's events in a thread, `replay` sends warm-up requests and then a
trace through the router's gRPC Generate, `CpuShare` says where the machine's CPU time went, and
`settle` waits for every worker's KV blocks to be free again (`leaked_blocks`: those that are not).
Used by bench/experiments/adaptive_trace.py.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import threading
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from bench import serve
from bench.cluster import start_process, stop_process
from bench.experiments import common
from bench.servebench.workload import DEFAULT_VOCAB, RequestSpec, random_ids

WORKER_ENV = {"RAY_worker_niceness": "0"}
"""Ray starts its worker processes at nice 15; on a shared machine any other process then takes their
cores first (measured: prefill 2x slower per token while another user's compiler ran). At nice 0 the
deployment competes as the plain processes of the other experiments do."""


class Deployment:
    """`pdserve serve` in its own process, and a Ray driver connection to its controller."""

    def __init__(self, name: str, config: dict[str, Any], log_dir: Path):
        self.name, self.config, self.log_dir = name, config, log_dir
        self.proc = None
        self.controller = None

    def __enter__(self) -> Deployment:
        from deploy import launcher  # Ray: loaded only when a deployment starts

        self.log_dir.mkdir(parents=True, exist_ok=True)
        path = self.log_dir / f"{self.name}.yaml"
        path.write_text(yaml.safe_dump(self.config))
        self.proc = start_process(f"serve-{self.name}", ["-m", "deploy.cli", "--log-level", "WARNING", "serve", "-c", str(path),
                                                         "--grpc-port", "0", "--http-port", "0"], WORKER_ENV, timeout=300,
                                  log_path=self.log_dir / f"{self.name}.log")
        try:
            self.controller = launcher.controller_at(self.proc.ready["ray_address"])
        except BaseException:
            stop_process(self.proc, timeout=60)
            raise
        return self

    @property
    def grpc_address(self) -> str:
        return self.proc.address

    def events_since(self, since: float) -> list[dict]:
        import ray

        return ray.get(self.controller.events_since.remote(since), timeout=30)

    def status(self) -> dict:
        import ray

        return ray.get(self.controller.status.remote(), timeout=60)

    def __exit__(self, *exc) -> None:
        import ray

        ray.shutdown()
        stop_process(self.proc, timeout=90)


class EventPoller:
    """A thread that collects the controller's events every `interval_s` while the trace plays."""

    def __init__(self, deployment: Deployment, interval_s: float = 5.0):
        self.deployment, self.interval_s = deployment, interval_s
        self.events: list[dict] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="event-poller")

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.poll()

    def poll(self) -> None:
        since = self.events[-1]["time"] if self.events else 0.0
        try:
            self.events.extend(self.deployment.events_since(since))
        except Exception as exc:  # noqa: BLE001 - a missed poll is caught up by the next one
            common.log.warning("events poll failed: %r", exc)

    def __enter__(self) -> EventPoller:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(60)
        self.poll()


def replay(address: str, specs: list[RequestSpec], warmup: int) -> tuple[list[dict], float, float]:
    """Warm-up requests, then the trace; returns (records as dicts, duration, unix time of the trace's t=0)."""
    args = argparse.Namespace(temperature=0.0, ignore_eos=True, seed=0, skip_detokenize=True, request_timeout=600.0)

    async def go() -> tuple[list, float, float]:
        backend = serve.GrpcBackend(address, None, args)
        try:
            rng = np.random.default_rng(10_000)
            warm = [RequestSpec(i, 32, 8, 0.0, prompt_ids=random_ids(rng, 32, DEFAULT_VOCAB)) for i in range(warmup)]
            await serve.run_load(backend, warm, None, progress=False)
            t0 = time.time()
            records, duration = await serve.run_load(backend, specs, None, progress=False)
            return records, duration, t0
        finally:
            await backend.close()

    records, duration, t0 = asyncio.run(go())
    return [asdict(r) for r in records], duration, t0


class CpuShare:
    """Where the machine's CPU time went while the trace played: the deployment's process tree (the serve
    process, Ray's and every worker's), this process (the load generator) and everything else on the box
    (/proc/stat's busy time minus both: other users' work, which a shared machine does not stop)."""

    def __init__(self, root_pid: int):
        self.root_pid = root_pid
        self.start = self._sample()

    def _sample(self) -> tuple[float, dict[int, float], float, float]:
        import psutil

        with open("/proc/stat") as f:
            user, nice, system, _idle, _iowait, irq, softirq = (int(x) for x in f.readline().split()[1:8])
        busy = (user + nice + system + irq + softirq) / os.sysconf("SC_CLK_TCK")
        tree: dict[int, float] = {}
        root = psutil.Process(self.root_pid)
        for proc in [root, *root.children(recursive=True)]:
            try:
                t = proc.cpu_times()
                tree[proc.pid] = t.user + t.system
            except psutil.Error:
                continue
        own = psutil.Process().cpu_times()
        return busy, tree, own.user + own.system, time.monotonic()

    def stop(self) -> dict[str, float]:
        """Cores' worth of CPU (CPU seconds per second) used by each, over the time since the start."""
        busy0, tree0, own0, t0 = self.start
        busy1, tree1, own1, t1 = self._sample()
        span = max(1e-9, t1 - t0)
        deployment = sum(cpu - tree0.get(pid, 0.0) for pid, cpu in tree1.items())
        own = own1 - own0
        return {"deployment_cores": round(deployment / span, 3), "load_generator_cores": round(own / span, 3),
                "other_processes_cores": round(max(0.0, busy1 - busy0 - deployment - own) / span, 3)}


def leaked_blocks(status: dict) -> dict[str, int]:
    """KV blocks still held per worker once the trace is done (expected: none)."""
    return {w["id"]: w["total_kv_blocks"] - w["free_kv_blocks"] for pool in status["pools"].values() for w in pool["workers"]
            if w["total_kv_blocks"] - w["free_kv_blocks"]}


def settle(deployment: Deployment, timeout: float = 30.0) -> dict:
    """The controller's status once every worker's KV blocks are free again (or the timeout passed)."""
    deadline = time.monotonic() + timeout
    while True:
        status = deployment.status()
        if not leaked_blocks(status) or time.monotonic() > deadline:
            return status
        time.sleep(1.0)

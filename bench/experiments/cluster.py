"""A small launcher for the experiments: router + prefill/decode workers as real processes.

`BenchCluster(config, num_prefill, num_decode).start()` writes the YAML config, starts the decode
workers, then the prefill workers, then a router that knows them statically (no prefill worker =
colocated mode: the decode worker prefills locally), each as `python -m ...` with OS-assigned
ports on 127.0.0.1, and waits for each one's ready line. `stop()` sends SIGTERM to every process
it started (SIGKILL to its process group after a grace period).

Pinning: with `pin=True` (default: env `PDSERVE_BENCH_PIN`, "1" unless set to "0") every worker
command is wrapped in `taskset -c CORE`, one core per worker in start order (prefill workers first,
then decode workers) from `cores` (default: env `PDSERVE_BENCH_CORES`, e.g. "0,1", else all CPUs).
The router stays unpinned. Worker logs go to `log_dir`.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from common.serving import parse_ready

log = logging.getLogger("bench.cluster")
REPO = Path(__file__).resolve().parents[2]


def default_pin() -> bool:
    return os.environ.get("PDSERVE_BENCH_PIN", "1") != "0"


def default_cores() -> list[int]:
    env = os.environ.get("PDSERVE_BENCH_CORES")
    if env:
        return [int(c) for c in env.split(",") if c.strip()]
    return sorted(os.sched_getaffinity(0))


@dataclass
class Process:
    name: str
    popen: subprocess.Popen
    ready: dict = field(default_factory=dict)
    core: int | None = None
    lines: list[str] = field(default_factory=list)

    @property
    def address(self) -> str:
        return self.ready["address"]

    def alive(self) -> bool:
        return self.popen.poll() is None


def launch(name: str, args: list[str], log_path: Path, core: int | None = None, env: dict | None = None,
           timeout: float = 240.0) -> Process:
    """Starts `python ARGS` (under `taskset -c CORE` when core is set) and waits for its ready line."""
    cmd = [sys.executable, *args]
    if core is not None:
        cmd = [_taskset(), "-c", str(core), *cmd]
    popen = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}, start_new_session=True)
    proc = Process(name, popen, core=core)
    got_ready = threading.Event()
    log_path.parent.mkdir(parents=True, exist_ok=True)

    def pump() -> None:
        with open(log_path, "w") as sink:
            for line in popen.stdout:
                sink.write(line)
                sink.flush()
                proc.lines.append(line.rstrip())
                del proc.lines[:-200]
                event = None if got_ready.is_set() else parse_ready(line)
                if event is not None:
                    proc.ready.update(event)
                    got_ready.set()

    threading.Thread(target=pump, daemon=True, name=f"log-{name}").start()
    deadline = time.monotonic() + timeout
    try:
        while not got_ready.wait(0.1):
            if popen.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{name} did not start (log: {log_path}):\n" + "\n".join(proc.lines[-40:]))
    except BaseException:  # a failed start, or an interrupt while waiting: leave nothing behind
        terminate(proc, grace=20.0)
        raise
    return proc


def terminate(proc: Process, grace: float = 20.0) -> None:
    """SIGTERM the process we started; SIGKILL its own process group if it does not exit."""
    if proc.alive():
        proc.popen.send_signal(signal.SIGTERM)
        try:
            proc.popen.wait(grace)
            return
        except subprocess.TimeoutExpired:
            pass
    if proc.popen.poll() is None:
        try:
            os.killpg(proc.popen.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.popen.wait(5)


def _taskset() -> str:
    path = shutil.which("taskset")
    if path is None:
        raise RuntimeError("pinning needs `taskset` (util-linux); set PDSERVE_BENCH_PIN=0 to run unpinned")
    return path


def bench_config(transport: str = "tcp", **sections: dict[str, Any]) -> dict[str, Any]:
    """The experiments' base config: demo model, one torch thread per worker, small KV pool."""
    config: dict[str, Any] = {
        "model_name": "smollm2-135m",
        "engine": {"model": "smollm2-135m", "kv_cache_memory_mb": 256, "max_num_batched_tokens": 2048,
                   "max_num_seqs": 64, "num_threads": 1, "enable_chunked_prefill": True, "enable_prefix_caching": True},
        "kv_transfer": {"transport": transport, "host": "127.0.0.1", "layerwise": True, "timeout_s": 60},
        "router": {"host": "127.0.0.1", "max_queued_requests": 512, "request_timeout_s": 600},
    }
    for key, value in sections.items():
        config.setdefault(key, {}).update(value)
    return config


class BenchCluster:
    def __init__(self, config: dict[str, Any], num_prefill: int = 1, num_decode: int = 1, pin: bool | None = None,
                 cores: list[int] | None = None, log_dir: Path | None = None, name: str = "cluster", router: bool = True):
        self.config = config
        self.with_router = router
        self.num_prefill, self.num_decode = num_prefill, num_decode
        self.pin = default_pin() if pin is None else pin
        self.cores = cores or default_cores()
        self.name = name
        self.log_dir = log_dir or Path(tempfile.mkdtemp(prefix=f"pdserve-bench-{name}-"))
        self.prefill: list[Process] = []
        self.decode: list[Process] = []
        self.router: Process | None = None

    @property
    def grpc_address(self) -> str:
        return self.router.address

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.router.ready['http_port']}/v1"

    def describe(self) -> dict[str, Any]:
        return {
            "prefill_workers": self.num_prefill,
            "decode_workers": self.num_decode,
            "mode": "disaggregated" if self.num_prefill else "colocated",
            "pinned": self.pin,
            "cores": {p.name: p.core for p in [*self.prefill, *self.decode]},
            "config": self.config,
        }

    def _core(self, i: int) -> int | None:
        if not self.pin:
            return None
        if i >= len(self.cores):
            log.warning("%d workers on %d cores: worker %d shares a core", self.num_prefill + self.num_decode, len(self.cores), i)
        return self.cores[i % len(self.cores)]

    def start(self) -> BenchCluster:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        config_path = self.log_dir / "config.yaml"
        config_path.write_text(yaml.safe_dump(self.config))
        cfg = ["-c", str(config_path), "--log-level", "WARNING"]
        try:
            for i in range(self.num_decode):
                core = self._core(self.num_prefill + i)
                self.decode.append(launch(f"decode{i}", ["-m", "decode_worker", *cfg], self.log_dir / f"decode{i}.log", core))
            for i in range(self.num_prefill):
                self.prefill.append(launch(f"prefill{i}", ["-m", "prefill_worker", *cfg], self.log_dir / f"prefill{i}.log", self._core(i)))
            if not self.with_router:
                return self
            static = [a for p in self.prefill for a in ("--prefill", p.address)]
            static += [a for d in self.decode for a in ("--decode", d.address)]
            self.router = launch("router", ["-m", "router", *cfg, "--grpc-port", "0", "--http-port", "0", *static],
                                 self.log_dir / "router.log")
            self.wait_serving()
        except BaseException:
            self.stop()
            raise
        finally:
            log.info("%s: %s", self.name, {p.name: p.core for p in [*self.prefill, *self.decode]})
        return self

    def wait_serving(self, timeout: float = 30.0) -> None:
        import grpc
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        deadline = time.monotonic() + timeout
        with grpc.insecure_channel(self.router.address) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while time.monotonic() < deadline:
                try:
                    if stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=5).status == health_pb2.HealthCheckResponse.SERVING:
                        return
                except grpc.RpcError:
                    pass
                time.sleep(0.2)
        raise RuntimeError("router did not become SERVING")

    def alive(self) -> bool:
        return all(p.alive() for p in [self.router, *self.prefill, *self.decode] if p is not None)

    def stop(self) -> None:
        for proc in [self.router, *self.prefill, *self.decode]:
            if proc is not None:
                terminate(proc)

    def __enter__(self) -> BenchCluster:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

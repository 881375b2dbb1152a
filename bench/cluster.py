"""Start real pdserve processes on 127.0.0.1 and stop them all: the one harness of the tests and the benchmarks.

`start_process(name, args)` runs `python ARGS` (optionally under a prefix such as `ip netns exec NS`, or pinned
to one core with `taskset`), keeps its whole output (and copies it to a log file when given one), waits for its
ready line and records it in `STARTED`, so that a failing test shows what its processes said
(tests/conftest.py). `stop_process` sends SIGTERM, then SIGKILL to the process group after a grace period.

`LocalCluster(config, num_prefill, num_decode)` launches decode workers, prefill workers and a router with
OS-assigned ports (config: a YAML path, or a dict written next to the logs), statically wired or registering at
the router's internal address (`register=True`); `stop()` stops everything it started. Fault tests use
`send_signal`, `replace` (a fresh copy of a killed worker), `restart_router` (same gRPC ports) and `metrics`.
`BenchCluster` is the experiments' variant: workers pinned one core each (`PDSERVE_BENCH_PIN`,
`PDSERVE_BENCH_CORES`), quiet logs into a directory, `describe()` for the result JSON, and it returns only once
the router is SERVING. No prefill worker = colocated mode (the decode worker prefills locally).
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

import grpc
import yaml

from common.serving import parse_ready
from proto.pdserve.v1 import pdserve_pb2 as pb
from proto.pdserve.v1 import pdserve_pb2_grpc as pb_grpc

log = logging.getLogger("bench.cluster")
REPO = Path(__file__).resolve().parent.parent
LOG_TAIL_LINES = 80


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen
    ready: dict
    log_lines: list[str] = field(default_factory=list)
    args: list[str] = field(default_factory=list)
    env: dict = field(default_factory=dict)
    core: int | None = None

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def address(self) -> str:
        return self.ready["address"]

    def alive(self) -> bool:
        return self.popen.poll() is None

    def wait_for_line(self, text: str, timeout: float = 120.0) -> str:
        """The first log line containing `text` (e.g. a test hook's marker), waiting for it."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = next((line for line in list(self.log_lines) if text in line), None)
            if found is not None:
                return found
            if not self.alive():
                break
            time.sleep(0.05)
        raise AssertionError(f"{self.name} never logged {text!r}:\n" + "\n".join(self.log_lines[-20:]))

    def log_tail(self, lines: int = LOG_TAIL_LINES) -> tuple[str, str]:
        """(title, text): the last `lines` lines of its output, titled with its name, pid and whether it still runs."""
        code = self.popen.poll()
        state = "running" if code is None else f"exited {code}"
        return f"{self.name} (pid {self.pid}, {state}): last {lines} lines", "\n".join(list(self.log_lines)[-lines:])


STARTED: list[Proc] = []
"""Every process start_process started in this interpreter, in order."""


def start_process(name: str, args: list[str], env: dict | None = None, timeout: float = 240.0,
                  prefix: list[str] | None = None, log_path: Path | None = None, core: int | None = None) -> Proc:
    """`python ARGS` (after `prefix`, e.g. `ip netns exec NS`; under `taskset -c CORE` when `core` is set), once it
    printed its ready line. A failed start, or an interrupt while waiting, leaves nothing running."""
    pin = [_taskset(), "-c", str(core)] if core is not None else []
    popen = subprocess.Popen(
        [*(prefix or []), *pin, sys.executable, *args],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
        start_new_session=True,
    )
    proc = Proc(name, popen, {}, [], list(args), dict(env or {}), core)
    got_ready = threading.Event()
    sink = None
    if log_path is not None:
        log_path.parent.mkdir(parents=True, exist_ok=True)
        sink = open(log_path, "w")  # noqa: SIM115 - closed by the pump when the output ends

    def pump() -> None:
        for line in popen.stdout:
            if sink is not None:
                sink.write(line)
                sink.flush()
            proc.log_lines.append(line.rstrip())
            event = None if got_ready.is_set() else parse_ready(line)
            if event is not None:
                proc.ready.update(event)
                got_ready.set()
        if sink is not None:
            sink.close()

    threading.Thread(target=pump, daemon=True, name=f"log-{name}").start()
    deadline = time.monotonic() + timeout
    try:
        while not got_ready.wait(0.1):
            if popen.poll() is not None or time.monotonic() > deadline:
                where = f" (log: {log_path})" if log_path else ""
                raise RuntimeError(f"{name} did not start{where}:\n" + "\n".join(proc.log_lines[-40:]))
    except BaseException:
        stop_process(proc, timeout=20.0)
        raise
    STARTED.append(proc)
    return proc


def stop_process(proc: Proc, timeout: float = 20.0) -> None:
    """SIGTERM the process; SIGKILL its process group if it has not exited after `timeout` seconds."""
    if proc.alive():
        proc.popen.send_signal(signal.SIGTERM)
        try:
            proc.popen.wait(timeout)
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


def write_config(path: Path, transport: str = "ucx", **sections) -> Path:
    """The tests' config file: demo model in float32, a small KV pool, one torch thread, KV streamed layer by layer
    (what a GPU deployment does; tests/integration/test_conversation_reuse.py also runs the CPU default, after the
    prompt)."""
    config = {
        "engine": {"model": "smollm2-135m", "dtype": "float32", "kv_cache_memory_mb": 128, "max_num_batched_tokens": 1024, "num_threads": 1},
        "kv_transfer": {"transport": transport, "timeout_s": 20, "layerwise": True},
        "router": {"max_queued_requests": 64},
    }
    for key, value in sections.items():
        config.setdefault(key, {}).update(value)
    path.write_text(yaml.safe_dump(config))
    return path


def bench_config(transport: str = "tcp", **sections: dict[str, Any]) -> dict[str, Any]:
    """The experiments' base config: demo model, one torch thread per worker, chunked prefill, prefix caching."""
    config: dict[str, Any] = {
        "model_name": "smollm2-135m",
        "engine": {"model": "smollm2-135m", "kv_cache_memory_mb": 256, "max_num_batched_tokens": 2048,
                   "max_num_seqs": 64, "num_threads": 1, "enable_chunked_prefill": True, "enable_prefix_caching": True},
        "kv_transfer": {"transport": transport, "host": "127.0.0.1", "timeout_s": 60},
        "router": {"host": "127.0.0.1", "max_queued_requests": 512, "request_timeout_s": 600},
    }
    for key, value in sections.items():
        config.setdefault(key, {}).update(value)
    return config


class LocalCluster:
    def __init__(self, config: Path | dict[str, Any], num_prefill: int = 1, num_decode: int = 1, env: dict | None = None,
                 register: bool = False, process_env: dict[str, dict] | None = None, cores: list[int] | None = None,
                 log_dir: Path | None = None, router: bool = True, extra_args: list[str] | None = None):
        self.config = config
        self.config_path: Path | None = None if isinstance(config, dict) else Path(config)
        """The YAML file the processes read (for a dict config: written into log_dir when the cluster starts)."""
        self.num_prefill, self.num_decode = num_prefill, num_decode
        self.env = env or {}
        self.process_env = process_env or {}
        """Extra environment for single processes by name: router, prefill0, decode1, ..."""
        self.register = register
        self.cores = cores
        """Workers pinned one core each, prefill workers first, in this order (None: unpinned); the router never is."""
        self.log_dir = log_dir
        self.with_router = router
        self.extra_args = extra_args or []
        self.prefill: list[Proc] = []
        self.decode: list[Proc] = []
        self.router: Proc | None = None

    def start(self) -> LocalCluster:
        try:
            self.config_path = self._config_path()
            cfg = ["-c", str(self.config_path), *self.extra_args]
            extra: list[str] = []
            if self.register:
                self.router = self._start("router", ["-m", "router", *cfg, "--grpc-port", "0", "--http-port", "0"])
                extra = ["--router", self.router.ready["internal_address"]]
            for i in range(self.num_decode):
                self.decode.append(self._start(f"decode{i}", ["-m", "decode_worker", *cfg, *extra], self._core(self.num_prefill + i)))
            for i in range(self.num_prefill):
                self.prefill.append(self._start(f"prefill{i}", ["-m", "prefill_worker", *cfg, *extra], self._core(i)))
            if self.register:
                self.wait_registered()
            elif self.with_router:
                static = [a for p in self.prefill for a in ("--prefill", p.address)]
                static += [a for d in self.decode for a in ("--decode", d.address)]
                self.router = self._start("router", ["-m", "router", *cfg, "--grpc-port", "0", "--http-port", "0", *static])
        except BaseException:
            self.stop()
            raise
        return self

    def _config_path(self) -> Path:
        if not isinstance(self.config, dict):
            return Path(self.config)
        if self.log_dir is None:
            self.log_dir = Path(tempfile.mkdtemp(prefix="pdserve-cluster-"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        path = self.log_dir / "config.yaml"
        path.write_text(yaml.safe_dump(self.config))
        return path

    def _start(self, name: str, args: list[str], core: int | None = None) -> Proc:
        log_path = self.log_dir / f"{name}.log" if self.log_dir is not None else None
        return start_process(name, args, {**self.env, **self.process_env.get(name, {})}, log_path=log_path, core=core)

    def _core(self, i: int) -> int | None:
        if not self.cores:
            return None
        if i >= len(self.cores):
            log.warning("%d workers on %d cores: worker %d shares a core", self.num_prefill + self.num_decode, len(self.cores), i)
        return self.cores[i % len(self.cores)]

    def wait_registered(self, timeout: float = 30.0) -> None:
        """Until the router's health says SERVING (for a registering cluster: every worker registered)."""
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
        raise RuntimeError("the router did not become SERVING (workers did not register?)")

    def alive(self) -> bool:
        return all(p.alive() for p in [self.router, *self.prefill, *self.decode] if p is not None)

    def stop(self) -> None:
        for proc in [self.router, *self.prefill, *self.decode]:
            if proc is not None:
                stop_process(proc)

    def send_signal(self, proc: Proc, sig: signal.Signals = signal.SIGKILL) -> float:
        """Send `sig` to `proc`'s process group (SIGKILL also reaps it); returns when it was sent."""
        os.killpg(proc.popen.pid, sig)
        sent = time.monotonic()
        if sig == signal.SIGKILL:
            proc.popen.wait(10)
        return sent

    def replace(self, proc: Proc, env: dict | None = None) -> Proc:
        """Start a fresh copy of a (killed) worker with the same arguments and, unless given, env."""
        stop_process(proc)
        fresh = start_process(proc.name, proc.args, proc.env if env is None else env, core=proc.core)
        group = self.decode if proc in self.decode else self.prefill
        group[group.index(proc)] = fresh
        return fresh

    def restart_router(self, sig: signal.Signals = signal.SIGKILL) -> float:
        """Stop the router with `sig` and start a new one on the same gRPC ports (public and
        internal); returns when the old one was signalled. Registered workers re-register with
        the new one on their own."""
        old = self.router
        args = list(old.args)
        if "--internal-port" in args:  # restarted before
            del args[args.index("--internal-port"):args.index("--internal-port") + 2]
        args[args.index("--grpc-port") + 1] = str(old.ready["grpc_port"])
        args += ["--internal-port", str(old.ready["internal_port"])]
        sent = self.send_signal(old, sig)
        old.popen.wait(30)
        self.router = start_process("router", args, old.env)
        return sent

    def metrics(self) -> dict[tuple[str, tuple], float]:
        """The router's Prometheus samples: {(name, sorted label items): value}."""
        import requests
        from prometheus_client.parser import text_string_to_metric_families

        text = requests.get(self.http_url + "/metrics", timeout=10).text
        return {(s.name, tuple(sorted(s.labels.items()))): s.value
                for family in text_string_to_metric_families(text) for s in family.samples}

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.router.ready['http_port']}"

    @property
    def grpc_address(self) -> str:
        return self.router.address

    def worker_stats(self, proc: Proc) -> pb.WorkerStats:
        with grpc.insecure_channel(proc.address) as channel:
            stub = (pb_grpc.DecodeWorkerStub if proc in self.decode else pb_grpc.PrefillWorkerStub)(channel)
            return stub.Stats(pb.StatsRequest(), timeout=10)

    def assert_no_leaked_blocks(self, timeout: float = 15.0) -> None:
        """Every live worker's KV blocks are all free again (waits briefly for aborts to land)."""
        deadline = time.monotonic() + timeout
        for proc in [*self.prefill, *self.decode]:
            if not proc.alive():
                continue
            while True:
                stats = self.worker_stats(proc)
                if stats.free_kv_blocks == stats.total_kv_blocks and stats.running_requests == 0:
                    break
                if time.monotonic() > deadline:
                    raise AssertionError(f"{proc.name}: {stats.total_kv_blocks - stats.free_kv_blocks} KV blocks leaked ({stats})")
                time.sleep(0.2)

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


class BenchCluster(LocalCluster):
    """The experiments' cluster: a config dict, workers pinned (unless `pin` is False or PDSERVE_BENCH_PIN=0) on
    `cores` (default: PDSERVE_BENCH_CORES, e.g. "0,1", else every CPU this process may use), WARNING-level logs
    in `log_dir` (default: a fresh temporary directory), started only once the router is SERVING."""

    def __init__(self, config: dict[str, Any], num_prefill: int = 1, num_decode: int = 1, pin: bool | None = None,
                 cores: list[int] | None = None, log_dir: Path | None = None, name: str = "cluster", router: bool = True,
                 register: bool = False):
        pin = default_pin() if pin is None else pin
        super().__init__(config, num_prefill, num_decode, cores=(cores or default_cores()) if pin else None,
                         log_dir=log_dir or Path(tempfile.mkdtemp(prefix=f"pdserve-bench-{name}-")), router=router,
                         extra_args=["--log-level", "WARNING"], register=register)
        self.name = name

    def start(self) -> BenchCluster:
        super().start()
        log.info("%s: %s", self.name, {p.name: p.core for p in [*self.prefill, *self.decode]})
        if self.router is not None:
            try:
                self.wait_registered()
            except BaseException:
                self.stop()
                raise
        return self

    def describe(self) -> dict[str, Any]:
        return {
            "prefill_workers": self.num_prefill,
            "decode_workers": self.num_decode,
            "mode": "disaggregated" if self.num_prefill else "colocated",
            "pinned": self.cores is not None,
            "cores": {p.name: p.core for p in [*self.prefill, *self.decode]},
            "config": self.config,
        }


def default_pin() -> bool:
    return os.environ.get("PDSERVE_BENCH_PIN", "1") != "0"


def default_cores() -> list[int]:
    env = os.environ.get("PDSERVE_BENCH_CORES")
    if env:
        return [int(c) for c in env.split(",") if c.strip()]
    return sorted(os.sched_getaffinity(0))


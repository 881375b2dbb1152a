"""Start real pdserve processes on 127.0.0.1 for integration tests, and stop them all.

`LocalCluster` writes a YAML config, launches decode workers, prefill workers and a router as
separate `python -m ...` processes with OS-assigned ports, waits for each one's ready line, and
on `stop()` sends SIGTERM (then SIGKILL) to everything it started. Every process `start_process` starts
is kept in `STARTED` with its whole output, so that a failing test shows what its processes said
(tests/conftest.py). Fault tests use
`send_signal` (SIGKILL / SIGSTOP / SIGCONT one process), `replace` (start a fresh copy of a killed worker),
`restart_router` (same gRPC ports, so registered workers find its internal port again) and `metrics`.
Workers register at the router's internal address (its ready line's `internal_address`).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import yaml

from common.serving import parse_ready
from proto.pdserve.v1 import pdserve_pb2 as pb
from proto.pdserve.v1 import pdserve_pb2_grpc as pb_grpc

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
"""Every process start_process started in this run of pytest, in order."""


def start_process(name: str, args: list[str], env: dict | None = None, timeout: float = 180.0,
                  prefix: list[str] | None = None) -> Proc:
    """`python ARGS` (after `prefix`, e.g. `ip netns exec NS`), once it printed its ready line."""
    popen = subprocess.Popen(
        [*(prefix or []), sys.executable, *args],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
        start_new_session=True,
    )
    lines: list[str] = []
    ready: dict = {}
    got_ready = threading.Event()

    def pump() -> None:
        for line in popen.stdout:
            lines.append(line.rstrip())
            event = None if got_ready.is_set() else parse_ready(line)
            if event is not None:
                ready.update(event)
                got_ready.set()

    threading.Thread(target=pump, daemon=True).start()
    deadline = time.monotonic() + timeout
    while not got_ready.wait(0.1):
        if popen.poll() is not None or time.monotonic() > deadline:
            popen.kill()
            raise RuntimeError(f"{name} did not start:\n" + "\n".join(lines[-40:]))
    proc = Proc(name, popen, ready, lines, list(args), dict(env or {}))
    STARTED.append(proc)
    return proc


def stop_process(proc: Proc, timeout: float = 20.0) -> None:
    if proc.alive():
        proc.popen.send_signal(signal.SIGTERM)
        try:
            proc.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.popen.pid, signal.SIGKILL)
            proc.popen.wait(5)


def write_config(path: Path, transport: str = "ucx", **sections) -> Path:
    config = {
        "engine": {"model": "smollm2-135m", "dtype": "float32", "kv_cache_memory_mb": 128, "max_num_batched_tokens": 1024, "num_threads": 1},
        "kv_transfer": {"transport": transport, "timeout_s": 20},
        "router": {"max_queued_requests": 64},
    }
    for key, value in sections.items():
        config.setdefault(key, {}).update(value)
    path.write_text(yaml.safe_dump(config))
    return path


class LocalCluster:
    def __init__(self, config_path: Path, num_prefill: int = 1, num_decode: int = 1, env: dict | None = None,
                 register: bool = False, process_env: dict[str, dict] | None = None):
        self.config_path = config_path
        self.num_prefill, self.num_decode = num_prefill, num_decode
        self.env = env or {}
        self.process_env = process_env or {}
        """Extra environment for single processes by name: router, prefill0, decode1, ..."""
        self.register = register
        self.prefill: list[Proc] = []
        self.decode: list[Proc] = []
        self.router: Proc | None = None

    def start(self) -> LocalCluster:
        try:
            cfg = ["-c", str(self.config_path)]
            if self.register:
                self.router = start_process("router", ["-m", "router", *cfg, "--grpc-port", "0", "--http-port", "0"], self.env)
                extra = ["--router", self.router.ready["internal_address"]]
            else:
                extra = []
            for i in range(self.num_decode):
                self.decode.append(start_process(f"decode{i}", ["-m", "decode_worker", *cfg, *extra], self._env(f"decode{i}")))
            for i in range(self.num_prefill):
                self.prefill.append(start_process(f"prefill{i}", ["-m", "prefill_worker", *cfg, *extra], self._env(f"prefill{i}")))
            if not self.register:
                static = [a for p in self.prefill for a in ("--prefill", p.address)]
                static += [a for d in self.decode for a in ("--decode", d.address)]
                self.router = start_process("router", ["-m", "router", *cfg, "--grpc-port", "0", "--http-port", "0", *static], self.env)
            else:
                self.wait_registered()
        except BaseException:
            self.stop()
            raise
        return self

    def _env(self, name: str) -> dict:
        return {**self.env, **self.process_env.get(name, {})}

    def wait_registered(self, timeout: float = 30.0) -> None:
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        deadline = time.monotonic() + timeout
        with grpc.insecure_channel(self.router.address) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while time.monotonic() < deadline:
                if stub.Check(health_pb2.HealthCheckRequest(service="")).status == health_pb2.HealthCheckResponse.SERVING:
                    return
                time.sleep(0.2)
        raise RuntimeError("workers did not register with the router")

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
        fresh = start_process(proc.name, proc.args, proc.env if env is None else env)
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

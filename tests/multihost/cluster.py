"""A pdserve cluster over several namespace hosts: one Ray node per host, `pdserve serve` on host 1.

Lifecycle: `MultiHostCluster(hosts).up()` creates the network (bench/net.py), sets
each host's link rate, starts `ray start --head` in host 1 and `ray start --address` in every
other host (each with `--node-ip-address <its IP>`, its own `--temp-dir`, and a custom resource
`host_<i>` plus whatever the host spec adds, so configs pin pools with `resources`).
`serve(config)` runs `pdserve serve --address <head>` inside host 1 and waits for its ready
line. `kill_host(i)` SIGKILLs every process in host i at once (a node dies). `down()` stops the
serve process (SIGTERM, then SIGKILL), then removes every namespace (which SIGKILLs whatever is
still in it, by pid) and the hosts' Ray temp dirs. `down()` is idempotent and also runs at
interpreter exit and on SIGTERM, so a failing or interrupted test leaves nothing behind.
A state file (`STATE_FILE`) records the running cluster for `python -m tests.multihost status`.
"""

from __future__ import annotations

import atexit
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from bench import net
from bench.cluster import REPO, Proc, start_process, stop_process

RAY_PORT = 6379
WORK_DIR = Path("/tmp/pdmh")
STATE_FILE = WORK_DIR / "cluster.json"
TOKEN_FILE = WORK_DIR / "ray_token"
BIN = Path(sys.executable).parent


@dataclass
class HostSpec:
    num_cpus: int = 1
    resources: dict[str, float] = field(default_factory=dict)
    rate_gbps: float | None = None
    """Link rate of this host (tc tbf, each direction); None: unlimited."""


class MultiHostCluster:
    def __init__(self, hosts: list[HostSpec], env: dict[str, str] | None = None):
        self.specs = hosts
        self.env = env or {}
        self.network = net.Network(len(hosts))
        self.serve_proc: Proc | None = None
        self._down = False

    @property
    def head_address(self) -> str:
        return f"{net.host_ip(1)}:{RAY_PORT}"

    def up(self) -> MultiHostCluster:
        atexit.register(self.down)
        _on_sigterm(self.down)
        try:
            WORK_DIR.mkdir(parents=True, exist_ok=True)
            TOKEN_FILE.write_text(secrets.token_hex(32))
            TOKEN_FILE.chmod(0o600)
            self.network.create()
            for i, spec in enumerate(self.specs, start=1):
                self.network.set_rate(i, spec.rate_gbps)
            for i in range(1, len(self.specs) + 1):
                self._ray_start(i)
            self._save_state()
        except BaseException:
            self.down()
            raise
        return self

    def _ray_start(self, i: int) -> None:
        spec = self.specs[i - 1]
        temp = WORK_DIR / f"h{i}"
        temp.mkdir(parents=True, exist_ok=True)
        role = ["--head", f"--port={RAY_PORT}", "--include-dashboard=false"] if i == 1 else [f"--address={self.head_address}"]
        resources = {f"host_{i}": 1, **spec.resources}
        cmd = [str(BIN / "ray"), "start", *role, f"--node-ip-address={net.host_ip(i)}", f"--num-cpus={spec.num_cpus}",
               f"--resources={json.dumps(resources)}", f"--temp-dir={temp}", "--disable-usage-stats"]
        result = self.run_in(i, cmd, timeout=180)
        if result.returncode != 0:
            raise RuntimeError(f"ray start on host {i} failed:\n{result.stdout[-2000:]}\n{result.stderr[-2000:]}")

    def process_env(self) -> dict[str, str]:
        # Ray token authentication with the harness's own token (not ~/.ray), as a real cluster would run
        return {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1", "RAY_USAGE_STATS_ENABLED": "0",
                "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(TOKEN_FILE), **self.env}

    def run_in(self, i: int, argv: list[str], timeout: float = 120) -> subprocess.CompletedProcess:
        """Run a command inside host i and wait for it."""
        return subprocess.run(["ip", "netns", "exec", net.host_ns(i), *argv], cwd=REPO, env=self.process_env(),
                              capture_output=True, text=True, timeout=timeout, check=False)

    def serve(self, config: Path, timeout: float = 600) -> Proc:
        """`pdserve serve --address <head>` inside host 1; returns once it printed its ready line."""
        args = ["-m", "deploy.cli", "serve", "-c", str(config), "--address", self.head_address,
                "--grpc-port", "0", "--http-port", "0"]
        self.serve_proc = start_process("pdserve-serve", args, self._env_delta(), timeout=timeout,
                                        prefix=["ip", "netns", "exec", net.host_ns(1)])
        self._save_state()
        return self.serve_proc

    def _env_delta(self) -> dict[str, str]:
        full = self.process_env()
        return {k: v for k, v in full.items() if os.environ.get(k) != v}

    def cli(self, *args: str, timeout: float = 180) -> subprocess.CompletedProcess:
        """`pdserve ARGS --address <head>` run inside host 1."""
        return self.run_in(1, [sys.executable, "-m", "deploy.cli", *args, "--address", self.head_address], timeout)

    def status(self) -> dict:
        result = self.cli("status", "--json")
        if result.returncode != 0:
            raise RuntimeError(f"pdserve status failed:\n{result.stdout}\n{result.stderr}")
        return json.loads(result.stdout)

    def kill_host(self, i: int) -> list[int]:
        """Every process of host i killed at once (SIGKILL): the node dies, its link stays."""
        return net.kill_namespace_processes(net.host_ns(i))

    def down(self) -> None:
        if self._down:
            return
        self._down = True
        if self.serve_proc is not None:
            stop_process(self.serve_proc, timeout=60)
        self.network.destroy()
        for i in range(1, len(self.specs) + 1):
            shutil.rmtree(WORK_DIR / f"h{i}", ignore_errors=True)
        STATE_FILE.unlink(missing_ok=True)
        TOKEN_FILE.unlink(missing_ok=True)

    def _save_state(self) -> None:
        WORK_DIR.mkdir(parents=True, exist_ok=True)
        state = {"hosts": [{"ns": net.host_ns(i), "ip": net.host_ip(i), "rate_gbps": s.rate_gbps,
                            "resources": {f"host_{i}": 1, **s.resources}} for i, s in enumerate(self.specs, start=1)],
                 "ray_address": self.head_address,
                 "serve": self.serve_proc.ready if self.serve_proc else None}
        STATE_FILE.write_text(json.dumps(state, indent=2))


def remove_leftovers() -> list[str]:
    """Everything the harness may have left (after a crash): its namespaces, processes, temp dirs."""
    found = net.remove_leftovers()
    shutil.rmtree(WORK_DIR, ignore_errors=True)
    return found


def _on_sigterm(cleanup) -> None:
    previous = signal.getsignal(signal.SIGTERM)

    def handler(signum, frame) -> None:
        cleanup()
        if callable(previous):
            previous(signum, frame)
        else:
            raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, handler)

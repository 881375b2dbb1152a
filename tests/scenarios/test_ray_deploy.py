"""`pdserve serve` on a real embedded Ray (this machine's CPUs) with the demo model.

One `pdserve serve` subprocess per test. While a background load sends requests the whole time:
scale the decode pool up and down with `pdserve scale` (checked with `pdserve status --json`), and
let the autoscaler grow and shrink the prefill pool; not one request may fail. SIGTERM then drains
and stops everything: the process exits 0 and leaves no process of its session behind.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import psutil
import pytest

from bench.cluster import REPO, Proc, start_process, write_config
from proto.pdserve.v1 import pdserve_pb2 as pb
from proto.pdserve.v1 import pdserve_pb2_grpc as pb_grpc
from tests.conftest import wait_for as poll

pytestmark = pytest.mark.timeout(420)


# ---- helpers ---------------------------------------------------------------------------------
_T0 = [time.monotonic()]


def phase(what: str) -> None:
    """Progress with elapsed seconds (shown with -s; no assertion on time)."""
    print(f"[{time.monotonic() - _T0[0]:6.1f} s] {what}", flush=True)


def start_serve(config: Path) -> Proc:
    _T0[0] = time.monotonic()
    return start_process("pdserve-serve", ["-m", "deploy.cli", "serve", "-c", str(config), "--grpc-port", "0", "--http-port", "0"],
                         timeout=240)


def cli(serve: Proc, *args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    """Run `pdserve ARGS --address <the serve's Ray>` and return it (check=True)."""
    result = subprocess.run([sys.executable, "-m", "deploy.cli", *args, "--address", serve.ready["ray_address"]],
                            cwd=REPO, capture_output=True, text=True, timeout=timeout, check=False)
    assert result.returncode == 0, f"pdserve {' '.join(args)} failed:\n{result.stdout}\n{result.stderr}"
    return result


def status(serve: Proc) -> dict:
    return json.loads(cli(serve, "status", "--json").stdout)


def healthy(report: dict, role: str) -> list[dict]:
    return [w for w in report["pools"][role]["workers"] if w["health"] == "healthy"]


def wait_for(predicate, timeout: float, what: str, interval: float = 1.0):
    """tests.conftest.wait_for, polling the deployment once a second by default (most predicates run `pdserve status`)."""
    return poll(predicate, timeout, what, interval)


def generate(address: str, prompt_ids: list[int], max_tokens: int) -> pb.GenerateResponse:
    """One request through the router's gRPC Generate; returns the last message."""
    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.RouterStub(channel)
        request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt_ids),
                                     sampling=pb.SamplingParams(max_tokens=max_tokens, temperature=0.0))
        tokens, last = 0, None
        for response in stub.Generate(request, timeout=120):
            tokens += len(response.chunk.token_ids)
            last = response
    assert last is not None and last.finish_reason in (pb.FINISH_REASON_STOP, pb.FINISH_REASON_LENGTH), last
    assert tokens > 0
    return last


class Load:
    """Client threads sending requests back to back until stopped; every outcome is kept."""

    def __init__(self, address: str, prompts: list[list[int]], threads: int, max_tokens: int):
        self.address, self.prompts, self.max_tokens = address, prompts, max_tokens
        self.stop_event = threading.Event()
        self.ok = 0
        self.failures: list[str] = []
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(threads)]

    def __enter__(self) -> Load:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> None:
        self.stop_event.set()
        for t in self._threads:
            t.join(150)

    def _run(self, index: int) -> None:
        i = index
        while not self.stop_event.is_set():
            prompt = self.prompts[i % len(self.prompts)]
            i += 1
            try:
                generate(self.address, prompt, self.max_tokens)
                with self._lock:
                    self.ok += 1
            except Exception as exc:  # noqa: BLE001 - every failure is reported by the test
                with self._lock:
                    self.failures.append(repr(exc))

    def wait_ok(self, n: int, timeout: float = 120) -> None:
        start = self.ok
        wait_for(lambda: self.ok >= start + n or self.failures, timeout, f"{n} more requests")
        assert not self.failures, self.failures


def session_processes(sid: int) -> list[psutil.Process]:
    """Live processes of the session the serve process leads (Ray's daemons and workers included)."""
    found = []
    for proc in psutil.process_iter(["pid", "name", "status"]):
        try:
            if os.getsid(proc.pid) == sid and proc.info["status"] != psutil.STATUS_ZOMBIE:
                found.append(proc)
        except (ProcessLookupError, PermissionError, psutil.Error):
            continue
    return found


def stop_and_check_nothing_left(serve: Proc, seen: set[tuple[int, float]]) -> None:
    serve.popen.send_signal(signal.SIGTERM)
    try:
        rc = serve.popen.wait(150)
    except subprocess.TimeoutExpired:
        os.killpg(serve.popen.pid, signal.SIGKILL)
        raise AssertionError("pdserve serve did not exit after SIGTERM:\n" + "\n".join(serve.log_lines[-40:])) from None
    assert rc == 0, "\n".join(serve.log_lines[-40:])

    def leftovers() -> list[str]:
        procs = {p.pid: p for p in session_processes(serve.popen.pid)}
        procs.update({pid: psutil.Process(pid) for pid, created in seen if _alive(pid, created)})
        return [f"{pid} {_describe(p)}" for pid, p in procs.items()]

    try:
        wait_for(lambda: not leftovers(), 30, "every process of the deployment is gone", interval=0.5)
    except AssertionError:
        raise AssertionError(f"processes left behind: {leftovers()}") from None


def remember_tree(serve: Proc, seen: set[tuple[int, float]]) -> None:
    for child in psutil.Process(serve.popen.pid).children(recursive=True):
        try:
            seen.add((child.pid, child.create_time()))
        except psutil.Error:
            pass


def _alive(pid: int, created: float) -> bool:
    try:
        proc = psutil.Process(pid)
        return proc.create_time() == created and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _describe(proc: psutil.Process) -> str:
    try:
        return " ".join(proc.cmdline())[:120]
    except psutil.Error:
        return "?"


@pytest.fixture
def serve_guard():
    """Kills a serve process (and its session) that a failing test left running."""
    procs: list[Proc] = []
    yield procs
    for proc in procs:
        if proc.alive():
            proc.popen.send_signal(signal.SIGTERM)
            try:
                proc.popen.wait(90)
            except subprocess.TimeoutExpired:
                os.killpg(proc.popen.pid, signal.SIGKILL)
        for leftover in session_processes(proc.popen.pid):
            leftover.kill()


# ---- tests -----------------------------------------------------------------------------------
def test_serve_scale_decode_under_load_then_sigterm(tmp_path, demo_prompt_ids, serve_guard):
    config = write_config(
        tmp_path / "pdserve.yaml", transport="tcp",
        engine={"kv_cache_memory_mb": 128},
        pools={"prefill": {"replicas": 1, "min_replicas": 1, "max_replicas": 1, "num_cpus": 0.5},
               "decode": {"replicas": 1, "min_replicas": 1, "max_replicas": 2, "num_cpus": 0.5}},
    )
    serve = start_serve(config)
    serve_guard.append(serve)
    seen: set[tuple[int, float]] = set()
    remember_tree(serve, seen)
    address = serve.ready["grpc"]
    assert serve.ready["grpc_port"] > 0 and serve.ready["http"].startswith("http://127.0.0.1:")
    # the JSON ready line ends start_serve's wait; the human one follows it and may not have been read yet
    assert serve.wait_for_line("pdserve ready: grpc=", timeout=30).startswith("pdserve ready: grpc=")
    phase("ready")
    generate(address, demo_prompt_ids[0], 8)

    with Load(address, demo_prompt_ids, threads=4, max_tokens=40) as load:
        load.wait_ok(2)
        shown = cli(serve, "status").stdout  # the last minute's critical path and the verdict, with its reason
        assert "critical path  last 60 s:" in shown and "disaggregation: " in shown and "deciding stage: " in shown, shown
        phase("load running; scaling decode to 2")
        up = json.loads(cli(serve, "scale", "decode=2", "--json").stdout)
        assert up["replicas"] == 2 and len(up["added"]) == 1 and not up["errors"], up
        report = status(serve)
        assert len(healthy(report, "decode")) == 2, report["pools"]["decode"]
        assert report["router"]["health"] == "healthy"
        remember_tree(serve, seen)
        new_worker = up["added"][0]
        # the new worker serves requests too (it received KV from the prefill worker)
        wait_for(lambda: any(w["id"] == new_worker and w["kv_bytes_received"] > 0 for w in status(serve)["pools"]["decode"]["workers"]),
                 90, f"{new_worker} to serve requests", interval=2.0)
        load.wait_ok(4)
        phase("decode-2 serving; scaling decode to 1")
        down = json.loads(cli(serve, "scale", "decode=1", "--json").stdout)
        assert down["replicas"] == 1 and len(down["removed"]) == 1 and not down["errors"], down
        drained = down["removed"][0]
        assert "error" not in drained and drained["in_flight_left"] == 0, drained
        print(f"drained {drained['worker_id']}: {drained['in_flight_at_drain']} request(s) in flight, {drained['drain_s']} s")
        report = status(serve)
        assert [w["health"] for w in report["pools"]["decode"]["workers"]] == ["healthy"], report["pools"]["decode"]
        load.wait_ok(3)
    assert not load.failures, load.failures
    assert load.ok >= 9
    phase(f"{load.ok} requests, none failed; SIGTERM")

    stop_and_check_nothing_left(serve, seen)
    phase("stopped, nothing left")


def test_autoscaler_grows_and_shrinks_prefill_pool(tmp_path, demo_prompt_ids, serve_guard):
    config = write_config(
        tmp_path / "pdserve.yaml", transport="tcp",
        engine={"kv_cache_memory_mb": 192},
        router={"resources": {"pdserve_head": 1}},  # pins the router (how the k8s manifest keeps it on the head)
        pools={"prefill": {"replicas": 1, "min_replicas": 1, "max_replicas": 2, "num_cpus": 0.5},
               "decode": {"replicas": 1, "min_replicas": 1, "max_replicas": 1, "num_cpus": 0.5}},
        autoscaler={"enabled": True, "interval_s": 0.5, "upscale_cooldown_s": 1, "downscale_cooldown_s": 10,
                     "prefill": {"queued_prompt_tokens_per_worker": 64, "ttft_slo_s": 60},
                     "decode": {"kv_usage": 1.0, "running_requests_per_worker": 1000, "itl_slo_s": 60}},
    )
    serve = start_serve(config)
    serve_guard.append(serve)
    seen: set[tuple[int, float]] = set()
    remember_tree(serve, seen)
    address = serve.ready["grpc"]
    phase("ready")
    long_prompts = [ids * (480 // len(ids) + 1) for ids in demo_prompt_ids[:4]]

    with Load(address, long_prompts, threads=4, max_tokens=4) as burst:
        # a grow event lists the worker once it is registered and healthy; under this burst the pool may
        # shrink again soon after (the short cooldown), so the event is what is waited for, not the pool's size
        report = wait_for(lambda: (r := status(serve)) and _grown(r) and r, 150,
                          "the autoscaler to add a prefill worker", interval=1.0)
        remember_tree(serve, seen)
        grow = _grown(report)[-1]
        assert grow["reason"].startswith("autoscaler") and len(grow["added"]) == 1 and not grow["errors"], grow
    assert not burst.failures, burst.failures
    assert burst.ok > 0
    phase(f"prefill pool grew to 2 ({burst.ok} burst requests, none failed)")

    # idle apart from a trickle of short requests: the pool shrinks back, draining first
    with Load(address, demo_prompt_ids[:3], threads=1, max_tokens=4) as trickle:
        # the pool's size drops when the scale-down starts; its event is recorded once the drain is done
        report = wait_for(lambda: (r := status(serve)) and r["pools"]["prefill"]["replicas"] == 1 and _last_resize(r) in _shrunk(r) and r,
                          120, "the autoscaler to remove a prefill worker", interval=1.0)
        trickle.wait_ok(1)
    assert not trickle.failures, trickle.failures
    phase(f"prefill pool shrank to 1 ({trickle.ok} trickle requests, none failed)")
    shrink = _shrunk(report)
    assert shrink and shrink[-1]["removed"] and "error" not in shrink[-1]["removed"][0], report["events"]
    print(f"autoscaler events: {[(e['from'], e['to'], e['reason']) for e in report['events'] if e['pool'] == 'prefill']}; "
          f"drained {shrink[-1]['removed'][0]}")
    assert len(healthy(report, "prefill")) == 1

    stop_and_check_nothing_left(serve, seen)
    phase("stopped, nothing left")


def _shrunk(report: dict) -> list[dict]:
    """The status report's prefill scale-down events (2 -> 1)."""
    return [e for e in report["events"] if e["pool"] == "prefill" and e.get("from") == 2 and e.get("to") == 1]


def _grown(report: dict) -> list[dict]:
    """The status report's prefill scale-up events (1 -> 2)."""
    return [e for e in report["events"] if e["pool"] == "prefill" and e.get("from") == 1 and e.get("to") == 2]


def _last_resize(report: dict) -> dict | None:
    """The prefill pool's latest change of size."""
    return ([e for e in report["events"] if e["pool"] == "prefill" and "to" in e] or [None])[-1]


def test_role_switch_through_the_controller_under_load(tmp_path, demo_prompt_ids, serve_guard):
    """`pdserve role` on a Ray deployment: a decode worker becomes a prefill worker and back, in place,
    while requests run; its slot moves between the pools, none fails, and bad input names the field."""
    config = write_config(
        tmp_path / "pdserve.yaml", transport="tcp",
        pools={"prefill": {"replicas": 1, "min_replicas": 1, "max_replicas": 2, "num_cpus": 0.5},
               "decode": {"replicas": 2, "min_replicas": 1, "max_replicas": 2, "num_cpus": 0.5}},
    )
    serve = start_serve(config)
    serve_guard.append(serve)
    address = serve.ready["grpc"]
    worker = status(serve)["pools"]["decode"]["workers"][-1]["id"]
    with Load(address, demo_prompt_ids, threads=4, max_tokens=16) as load:
        load.wait_ok(2)
        phase(f"load running; switching {worker} to prefill")
        to_prefill = json.loads(cli(serve, "role", worker, "prefill", "--json").stdout)
        assert (to_prefill["previous_role"], to_prefill["role"]) == ("decode", "prefill"), to_prefill
        report = status(serve)
        assert worker in [w["id"] for w in healthy(report, "prefill")], report["pools"]
        assert worker not in [w["id"] for w in report["pools"]["decode"]["workers"]]
        wait_for(lambda: any(w["id"] == worker and w["kv_bytes_sent"] > 0 for w in status(serve)["pools"]["prefill"]["workers"]),
                 90, f"{worker} to prefill requests", interval=2.0)
        phase(f"{worker} prefills; switching back to decode")
        back = json.loads(cli(serve, "role", worker, "decode", "--json").stdout)
        assert back["role"] == "decode", back
        assert worker in [w["id"] for w in healthy(status(serve), "decode")]
        load.wait_ok(3)
    assert not load.failures, load.failures
    bad = subprocess.run([sys.executable, "-m", "deploy.cli", "role", "nobody", "decode", "--address", serve.ready["ray_address"]],
                         cwd=REPO, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "worker_id" in bad.stderr and "nobody" in bad.stderr, bad.stderr
    same = subprocess.run([sys.executable, "-m", "deploy.cli", "role", worker, "decode", "--address", serve.ready["ray_address"]],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert same.returncode == 2 and "role: the worker is already a decode worker" in same.stderr, same.stderr
    stop_and_check_nothing_left(serve, set())


def test_adaptive_controller_switches_a_decode_worker_to_prefill(tmp_path, demo_prompt_ids, serve_guard):
    """`autoscaler.adaptive.mode: adaptive`: long prompts queue at the one prefill worker while two decode
    workers idle; the controller moves a decode worker to prefill by a role switch (not a new worker),
    logs the decision with its inputs, and no request fails."""
    config = write_config(
        tmp_path / "pdserve.yaml", transport="tcp",
        engine={"kv_cache_memory_mb": 128},
        pools={"prefill": {"replicas": 1, "min_replicas": 1, "max_replicas": 2, "num_cpus": 0.5},
               "decode": {"replicas": 2, "min_replicas": 1, "max_replicas": 2, "num_cpus": 0.5}},
        autoscaler={"enabled": True, "interval_s": 0.5, "upscale_cooldown_s": 1, "downscale_cooldown_s": 600,
                    "prefill": {"queued_prompt_tokens_per_worker": 64, "ttft_slo_s": 60},
                    "decode": {"kv_usage": 1.0, "running_requests_per_worker": 1000, "itl_slo_s": 60},
                    "adaptive": {"mode": "adaptive", "hold_intervals": 2, "action_cooldown_s": 600, "queue_share": 0.99}},
    )
    serve = start_serve(config)
    serve_guard.append(serve)
    address = serve.ready["grpc"]
    phase("ready")
    long_prompts = [ids * (480 // len(ids) + 1) for ids in demo_prompt_ids[:4]]
    with Load(address, long_prompts, threads=4, max_tokens=4) as load:
        report = wait_for(lambda: (r := status(serve)) and len(healthy(r, "prefill")) == 2 and r, 180,
                          "the controller to switch a decode worker to prefill", interval=1.0)
        load.wait_ok(2)
    assert not load.failures, load.failures
    decisions = [e for e in report["events"] if e["pool"] == "controller"]
    assert decisions and decisions[0]["from"].startswith("1P/2D") and decisions[0]["to"].startswith("2P/1D"), report["events"]
    assert "prefill pressed" in decisions[0]["reason"] and decisions[0]["inputs"]["prefill"]["queued_prompt_tokens"] > 64
    prefill_ids = [w["id"] for w in report["pools"]["prefill"]["workers"]]
    assert sorted(i.split("-")[0] for i in prefill_ids) == ["decode", "prefill"], f"a switch, not a new worker: {prefill_ids}"
    print(f"events: {[(e['pool'], e.get('from'), e.get('to'), e['reason'], e.get('added')) for e in report['events']]}")
    assert report["autoscaler"]["mode"] == "adaptive" and len(report["pools"]["decode"]["workers"]) == 1
    phase(f"switched ({load.ok} requests, none failed): {decisions[0]['reason']}")
    stop_and_check_nothing_left(serve, set())

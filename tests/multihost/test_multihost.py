"""pdserve across hosts: each host a network namespace with its own IP and Ray node (tests/multihost/).

1. Three hosts (router + prefill on A, decode on B and C), a configured shared secret, every server on its
   host's IP: greedy output == HF, KV bytes counted under the configured transport, status shows
   each worker on its host.
2. Host C dies (every process killed at once) under 8 streams: all complete == HF on B, the
   controller reports the lost worker, no KV block leaked on the live workers.
3. The prefill host cannot reach decode host C's KV port (blackhole route on the prefill host):
   those transfers fail at once with a clear error, the router retries elsewhere, output == HF.
Each runs with the default `ucx` transport and with `tcp`. Tests 2 and 3 configure no `security`
section at all: they run on the secret `pdserve serve` generates for the deployment.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from bench import net
from tests.multihost.cluster import WORK_DIR, HostSpec, MultiHostCluster

pytestmark = pytest.mark.multihost

SECRET = "multihost-shared-secret-0123456789"
KV_TIMEOUT_S = 20.0
TRANSPORTS = ["ucx", "tcp"]


def write_config(path: Path, transport: str, prefill_on: dict, decode_on: dict, decode_replicas: int = 2,
                 secret: str | None = SECRET) -> Path:
    """`secret` None: no `security` section (the deployment generates its own secret)."""
    config = {
        "engine": {"model": "smollm2-135m", "dtype": "float32", "kv_cache_memory_mb": 96, "max_num_batched_tokens": 1024, "num_threads": 1},
        "kv_transfer": {"transport": transport, "timeout_s": KV_TIMEOUT_S},
        "router": {"resources": {"host_1": 0.5}, "prefill_retries": 3, "max_migrations": 3},
        "pools": {
            "prefill": {"replicas": 1, "min_replicas": 1, "max_replicas": 1, "num_cpus": 1, "resources": prefill_on},
            "decode": {"replicas": decode_replicas, "min_replicas": 1, "max_replicas": decode_replicas, "num_cpus": 1,
                       "resources": decode_on},
        },
    }
    if secret is not None:
        config["security"] = {"shared_secret": secret}
    path.write_text(yaml.safe_dump(config))
    return path


def run_client(cluster: MultiHostCluster, host: int, router: str, prompts: list[list[int]], max_tokens: int,
               sequential: bool = False, on_streaming=None) -> list[dict]:
    """Greedy streams from a client process inside `host`; `on_streaming(count)` after each first token."""
    argv = ["ip", "netns", "exec", net.host_ns(host), sys.executable, "-m", "tests.multihost.client", router,
            str(max_tokens), *(["--sequential"] if sequential else [])]
    proc = subprocess.Popen(argv, cwd=Path(__file__).parents[2], env=cluster.process_env(), stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    proc.stdin.write(json.dumps(prompts))
    proc.stdin.close()
    streaming, results = 0, None
    try:
        for line in proc.stdout:
            event = json.loads(line)
            if event["event"] == "streaming":
                streaming += 1
                if on_streaming is not None:
                    on_streaming(streaming)
            elif event["event"] == "done":
                results = event["results"]
        proc.wait(60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert results is not None, f"client exited {proc.returncode} without results"
    return results


def router_metrics(cluster: MultiHostCluster, http: str) -> str:
    code = f"import urllib.request; print(urllib.request.urlopen('{http}/metrics', timeout=30).read().decode())"
    result = cluster.run_in(1, [sys.executable, "-c", code])
    assert result.returncode == 0, result.stderr
    return result.stdout


def metric(text: str, name: str) -> float:
    """Sum of a Prometheus metric's samples whose name+labels start with `name`."""
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))


def assert_equal_hf(results: list[dict], prompts: list[list[int]], hf_greedy, max_tokens: int) -> None:
    for i, (result, prompt) in enumerate(zip(results, prompts, strict=True)):
        assert result["error"] is None, f"request {i} failed: {result['error']}"
        assert result["tokens"] == hf_greedy(tuple(prompt), max_tokens), f"request {i} differs from HF"


def workers(report: dict, role: str) -> list[dict]:
    return [w for w in report["pools"][role]["workers"] if w["health"] == "healthy"]


def wait_no_leak(cluster: MultiHostCluster, timeout: float = 120) -> dict:
    """Status once every live worker's KV blocks are all free again (fails with the last report)."""
    deadline, report = time.monotonic() + timeout, {}
    while time.monotonic() < deadline:
        report = cluster.status()
        live = workers(report, "prefill") + workers(report, "decode")
        if live and all(w["free_kv_blocks"] == w["total_kv_blocks"] > 0 for w in live):
            return report
        time.sleep(2)
    raise AssertionError(f"KV blocks still held on live workers: {json.dumps(report['pools'], indent=1)}")


def assert_generated_secret(report: dict) -> None:
    assert report["security"]["authenticated"] and report["security"]["secret"] == "generated for this deployment", report["security"]


def three_hosts() -> list[HostSpec]:
    """A: 2 CPUs (router + prefill); B and C: 1 CPU and one decode slot each."""
    return [HostSpec(num_cpus=2), HostSpec(resources={"decode_slot": 1}), HostSpec(resources={"decode_slot": 1})]


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_three_hosts_greedy_equals_hf(tmp_path, make_cluster, demo_prompt_ids, hf_greedy, transport):
    cluster = make_cluster(three_hosts())
    serve = cluster.serve(write_config(tmp_path / "c.yaml", transport, {"host_1": 0.5}, {"decode_slot": 1}))
    router = serve.ready["grpc"]
    assert router.startswith(net.host_ip(1) + ":"), router
    prompts = demo_prompt_ids[:4]
    assert_equal_hf(run_client(cluster, 1, router, prompts, 12), prompts, hf_greedy, 12)

    report = wait_no_leak(cluster)
    (prefill,) = workers(report, "prefill")
    decode = workers(report, "decode")
    assert prefill["node_ip"] == net.host_ip(1) and prefill["address"].startswith(net.host_ip(1) + ":")
    assert sorted(w["node_ip"] for w in decode) == [net.host_ip(2), net.host_ip(3)]
    for w in decode:
        assert w["address"].startswith(w["node_ip"] + ":"), w
        assert w["kv_bytes_received"] > 0, f"{w['id']} received no KV: both decode hosts must be used"
    moved = metric(router_metrics(cluster, serve.ready["http"]), f'pdserve_kv_transfer_bytes_total{{transport="{transport}"}}')
    assert moved == prefill["kv_bytes_sent"] == sum(w["kv_bytes_received"] for w in decode) > 0


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_host_loss_under_load_migrates_every_stream(tmp_path, make_cluster, demo_prompt_ids, hf_greedy, transport):
    cluster = make_cluster(three_hosts())
    serve = cluster.serve(write_config(tmp_path / "c.yaml", transport, {"host_1": 0.5}, {"decode_slot": 1}, secret=None))
    assert_generated_secret(cluster.status())
    before = {w["id"]: w["node_ip"] for w in workers(cluster.status(), "decode")}
    lost = sorted(wid for wid, ip in before.items() if ip == net.host_ip(3))
    assert lost, f"no decode worker on host 3: {before}"
    prompts = [demo_prompt_ids[i % len(demo_prompt_ids)] for i in range(8)]
    killed: list[int] = []

    def kill_host_c_once_all_stream(count: int) -> None:
        if count == len(prompts):
            killed.extend(cluster.kill_host(3))

    results = run_client(cluster, 1, serve.ready["grpc"], prompts, 48, on_streaming=kill_host_c_once_all_stream)
    assert killed, "host C was never killed (not every stream started)"
    assert_equal_hf(results, prompts, hf_greedy, 48)

    report = wait_no_leak(cluster)
    died = " ".join(e["reason"] for e in report["events"])
    assert all(f"{wid} died" in died for wid in lost), report["events"]
    live_decode = workers(report, "decode")
    assert [w["node_ip"] for w in live_decode] == [net.host_ip(2)], live_decode
    assert metric(router_metrics(cluster, serve.ready["http"]), "pdserve_migrations_total") > 0


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_unreachable_kv_port_fails_fast_and_retries_elsewhere(tmp_path, make_cluster, demo_prompt_ids, hf_greedy, transport):
    # A: router + decode, B: prefill, C: decode; B has no route to C (C stays reachable from A)
    specs = [HostSpec(num_cpus=2, resources={"decode_slot": 1}), HostSpec(), HostSpec(resources={"decode_slot": 1})]
    cluster = make_cluster(specs)
    net.ip("route", "add", "blackhole", f"{net.host_ip(3)}/32", ns=net.host_ns(2))
    serve = cluster.serve(write_config(tmp_path / "c.yaml", transport, {"host_2": 1}, {"decode_slot": 1}, secret=None))
    assert_generated_secret(cluster.status())
    prompts = demo_prompt_ids[:4]
    started = time.monotonic()
    results = run_client(cluster, 1, serve.ready["grpc"], prompts, 8, sequential=True)
    elapsed = time.monotonic() - started
    assert_equal_hf(results, prompts, hf_greedy, 8)
    assert max(r["elapsed_s"] for r in results) < KV_TIMEOUT_S, results  # failed transfers end before the KV timeout
    assert metric(router_metrics(cluster, serve.ready["http"]), "pdserve_prefill_retries_total") > 0
    router_logs = " ".join(p.read_text(errors="replace") for p in (WORK_DIR / "h1").glob("session_*/logs/*") if p.is_file())
    assert f"{net.host_ip(3)}" in router_logs and "prefill attempt" in router_logs
    print(f"4 requests, KV port of host C unreachable from the prefill host: {elapsed:.1f} s")
    wait_no_leak(cluster)

"""Secure by default: a `pdserve serve` with no `security` section (issue 19), on a real embedded Ray.

One deployment serves the module: the config sets API keys on the public API and nothing else.
A stranger on the network (no secret; it knows the model, the API and every address, which
`pdserve status` prints) tries to join and to call the cluster's internal services on the
router's public port, on its internal port and on the workers' own ports; a fake worker server
it runs counts every connection and byte that arrives while users send requests. Then the
generated secret is looked for in every log line, process command line and environment, and
every file of the Ray session and of the test. Last, plain processes without a secret: they
refuse a non-loopback internal address unless `security.allow_unauthenticated`, and then warn.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import grpc
import psutil
import pytest

from bench.cluster import REPO, Proc, start_process, stop_process, write_config
from common.sampling import SamplingParams
from common.secrets import SECRET_ENV
from kvtransfer import KVEndpoint, TransferHeader
from proto.convert import sampling_to_proto
from proto.pdserve.v1 import pdserve_pb2 as pb
from proto.pdserve.v1 import pdserve_pb2_grpc as pb_grpc
from router.client import RouterError, generate_via_router
from tests.integration.test_security import SMOLLM2, _code, push_kv_is_refused
from tests.scenarios.test_ray_deploy import cli, healthy, start_serve, status, stop_and_check_nothing_left, wait_for

pytestmark = pytest.mark.timeout(600)

API_KEY = "sk-default-deploy"
MODEL = "smollm2-135m"
READ_SECRET = """
import sys, ray
from deploy.launcher import _connect
from deploy.controller import CONTROLLER_NAME
from deploy.placement import NAMESPACE
assert _connect(sys.argv[1])
controller = ray.get_actor(CONTROLLER_NAME, namespace=NAMESPACE)
print(ray.get(controller.__ray_call__.remote(lambda self: self._secret.value)))
print(ray._private.worker._global_node.get_session_dir_path())
"""


class CountingListener:
    """A stranger's 'worker': a TCP port that accepts and counts every connection and byte."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.sock.getsockname()[1]}"
        self.connections = self.bytes = 0
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.connections += 1
            threading.Thread(target=self._drain, args=(conn,), daemon=True).start()

    def _drain(self, conn: socket.socket) -> None:
        with conn:
            while data := conn.recv(65536):
                self.bytes += len(data)

    def close(self) -> None:
        self.sock.close()


@pytest.fixture(scope="module")
def deployment(tmp_path_factory) -> Iterator[tuple[Proc, dict, Path]]:
    directory = tmp_path_factory.mktemp("default")
    config = write_config(directory / "pdserve.yaml", transport="tcp", engine={"kv_cache_memory_mb": 128},
                          router={"api_keys": [API_KEY]},
                          pools={"prefill": {"replicas": 1, "min_replicas": 1, "max_replicas": 1, "num_cpus": 0.5},
                                 "decode": {"replicas": 1, "min_replicas": 1, "max_replicas": 1, "num_cpus": 0.5}})
    assert "security" not in config.read_text()
    serve = start_serve(config)
    try:
        report = wait_for(lambda: (r := status(serve)) and len(healthy(r, "decode")) == 1 and len(healthy(r, "prefill")) == 1 and r,
                          120, "both workers healthy")
        yield serve, report, directory
        wait_for(lambda: all(w["free_kv_blocks"] == w["total_kv_blocks"] and w["running_requests"] == 0
                             for role in ("prefill", "decode") for w in status(serve)["pools"][role]["workers"]),
                 30, "no KV block leaked")
    finally:
        stop_and_check_nothing_left(serve, set())


def _generate(address: str, prompt: str, api_key: str = API_KEY) -> dict:
    return generate_via_router(address, prompt, SamplingParams(max_tokens=8), api_key=api_key)


def test_status_and_ready_line_show_the_planes_and_the_generated_secret(deployment):
    serve, report, _ = deployment
    assert report["security"] == {"authenticated": True, "secret": "generated for this deployment", "tls": False}
    router = report["router"]
    assert router["internal"] == serve.ready["internal"] and router["internal"] != router["grpc"]
    text = cli(serve, "status").stdout
    assert f"internal={router['internal']}" in text and "security authenticated (generated for this deployment)" in text


def test_a_stranger_is_refused_everywhere(deployment):
    serve, report, _ = deployment
    public, internal = serve.ready["grpc"], serve.ready["internal"]
    decode, prefill = report["pools"]["decode"]["workers"][0], report["pools"]["prefill"]["workers"][0]
    sampling = sampling_to_proto(SamplingParams(max_tokens=2))
    calls = {
        "Register": lambda ch, md: pb_grpc.RegistryStub(ch).Register(pb.RegisterRequest(worker=pb.WorkerInfo(
            worker_id="stranger-1", role=pb.ROLE_DECODE, address="127.0.0.1:9", model=MODEL)), metadata=md, timeout=10),
        "Heartbeat": lambda ch, md: pb_grpc.RegistryStub(ch).Heartbeat(pb.HeartbeatRequest(worker_id=decode["id"]),
                                                                       metadata=md, timeout=10),
        "Prefill": lambda ch, md: list(pb_grpc.PrefillWorkerStub(ch).Prefill(pb.PrefillRequest(
            request_id="x", token_ids=[1, 2, 3], sampling=sampling), metadata=md, timeout=10)),
        "Decode": lambda ch, md: list(pb_grpc.DecodeWorkerStub(ch).Decode(pb.DecodeRequest(
            request_id="x", token_ids=[1, 2, 3], sampling=sampling, local_prefill=True), metadata=md, timeout=10)),
        "DecodeStats": lambda ch, md: pb_grpc.DecodeWorkerStub(ch).Stats(pb.StatsRequest(), metadata=md, timeout=10),
        "PrefillStats": lambda ch, md: pb_grpc.PrefillWorkerStub(ch).Stats(pb.StatsRequest(), metadata=md, timeout=10),
    }
    # an API key is no credential for internal services, in any header
    credentials = [None, (("authorization", f"Bearer {API_KEY}"),), (("x-pdserve-secret", API_KEY),)]
    expected = {public: {name: grpc.StatusCode.UNIMPLEMENTED for name in calls},  # the public port serves Router only
                internal: {name: grpc.StatusCode.UNAUTHENTICATED if name in ("Register", "Heartbeat")
                           else grpc.StatusCode.UNIMPLEMENTED for name in calls},
                decode["address"]: {"Decode": grpc.StatusCode.UNAUTHENTICATED, "DecodeStats": grpc.StatusCode.UNAUTHENTICATED},
                prefill["address"]: {"Prefill": grpc.StatusCode.UNAUTHENTICATED, "PrefillStats": grpc.StatusCode.UNAUTHENTICATED}}
    for address, codes in expected.items():
        with grpc.insecure_channel(address) as channel:
            for name, code in codes.items():
                for metadata in credentials:
                    assert _code(calls[name], channel, metadata) == code, (address, name, metadata)
    _push_kv_without_the_secret(decode)
    assert len(healthy(status(serve), "decode")) == 1  # the stranger's heartbeat for the real worker changed nothing


def _push_kv_without_the_secret(decode: dict) -> None:
    """A KV push straight to the decode worker's KV port: the proof is checked before anything else."""
    endpoint = KVEndpoint(decode["address"].rsplit(":", 1)[0], decode["kv_port"], "tcp")
    push_kv_is_refused(endpoint, TransferHeader("stranger-transfer", "f" * 16, 40, **SMOLLM2), secret="")


def test_a_stranger_worker_never_sees_a_user_request(deployment):
    serve, _, _ = deployment
    fake = CountingListener()
    try:
        with grpc.insecure_channel(serve.ready["internal"]) as channel:
            registry = pb_grpc.RegistryStub(channel)
            info = pb.WorkerInfo(worker_id="stranger-1", role=pb.ROLE_DECODE, address=fake.address, model=MODEL)
            for metadata in (None, (("authorization", f"Bearer {API_KEY}"),)):
                assert _code(registry.Register, pb.RegisterRequest(worker=info), metadata=metadata, timeout=10) == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(RouterError) as info:
            _generate(serve.ready["grpc"], "Hello", api_key="")
        assert info.value.code == "UNAUTHENTICATED"
        results = [_generate(serve.ready["grpc"], f"Count to {n}.") for n in range(4)]
        assert all(r["token_ids"] for r in results)
        assert (fake.connections, fake.bytes) == (0, 0)
    finally:
        fake.close()


def test_the_generated_secret_is_nowhere_to_be_read(deployment):
    serve, _, directory = deployment
    _generate(serve.ready["grpc"], "One more request.")
    reader = subprocess.run([sys.executable, "-c", READ_SECRET, serve.ready["ray_address"]], cwd=REPO, capture_output=True,
                            text=True, timeout=120, check=False, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert reader.returncode == 0, reader.stderr[-2000:]
    secret, session_dir = reader.stdout.split()[-2:]
    assert len(secret) >= 32
    needle = secret.encode()
    assert not [i for i, line in enumerate(serve.log_lines) if secret in line], "the secret is in pdserve serve's output"
    ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True, check=True).stdout
    assert ps.count("\n") > 3 and secret not in ps, "the secret is on a command line"
    assert not _environments_with(needle), "the secret is in a process environment"
    files = [p for root in (Path(session_dir), directory) for p in root.rglob("*") if p.is_file() and not p.is_symlink()]
    assert any(p.suffix in (".log", ".err", ".out") for p in files)  # the scan really covers Ray's logs
    assert not [str(p) for p in files if needle in _read(p)], "the secret is in a file"


def _environments_with(needle: bytes) -> list[int]:
    pids = []
    for proc in psutil.process_iter(["pid"]):
        try:
            if needle in Path(f"/proc/{proc.pid}/environ").read_bytes():
                pids.append(proc.pid)
        except OSError:  # another user's process, or gone
            continue
    return pids


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError:
        return b""


PLAIN = {"router": ["-m", "router", "--grpc-port", "0", "--http-port", "0", "--internal-host", "0.0.0.0"],
         "prefill_worker": ["-m", "prefill_worker", "--host", "0.0.0.0"],
         "decode_worker": ["-m", "decode_worker", "--host", "0.0.0.0"]}


def test_plain_processes_without_a_secret_stay_on_loopback(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != SECRET_ENV}
    config = write_config(tmp_path / "plain.yaml", transport="tcp")
    for name, args in PLAIN.items():
        refused = subprocess.run([sys.executable, *args, "-c", str(config)], cwd=REPO, env=env, capture_output=True,
                                 text=True, timeout=180, check=False)
        assert refused.returncode == 2 and "security.shared_secret" in refused.stderr, (name, refused.stderr[-1500:])
    allowed = write_config(tmp_path / "allowed.yaml", transport="tcp", security={"allow_unauthenticated": True})
    router = start_process("router", [*PLAIN["router"], "-c", str(allowed)], {SECRET_ENV: ""})
    try:
        assert router.ready["internal_address"].startswith("0.0.0.0:")
        assert [line for line in router.log_lines if "WARNING" in line and "WITHOUT a cluster secret" in line]
    finally:
        stop_process(router)

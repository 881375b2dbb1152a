"""Security refusals against real processes on 127.0.0.1.

One cluster serves the whole module: a router, one prefill and one decode worker (tcp KV), all
with a shared secret (read from a file), TLS on every gRPC server and on HTTP (a self-signed CA
made for the test), and an API key on the public API. The workers register over TLS with the
secret. Every test ends with no KV block leaked.
"""

from __future__ import annotations

import http.client
import json
import ssl
import urllib.error
import urllib.request
from collections.abc import Iterator

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bench.cluster import LocalCluster, Proc, write_config
from common.sampling import SamplingParams
from common.security import Security, sync_channel
from kvtransfer import AuthenticationFailed, KVEndpoint, KVSender, TransferHeader
from proto.convert import sampling_to_proto
from proto.pdserve.v1 import pdserve_pb2 as pb
from proto.pdserve.v1 import pdserve_pb2_grpc as pb_grpc
from router.client import RouterError, generate_via_router
from tests.conftest import wait_until
from tests.unit.test_security import SECRET, WRONG, TLSFiles, make_tls

pytestmark = pytest.mark.timeout(300)

API_KEY = "sk-security-test"
PROMPT = "List three prime numbers."
MAX_NEW = 12
SECRET_MD = Security(secret=SECRET).call_metadata()
WRONG_MD = Security(secret=WRONG).call_metadata()
SMOLLM2 = {"num_layers": 30, "num_kv_heads": 3, "head_dim": 64, "block_size": 16, "dtype": "float32"}


class SecureCluster(LocalCluster):
    """LocalCluster whose own probes (registration wait, worker Stats) use TLS and the secret."""

    def __init__(self, *args, tls: TLSFiles, **kwargs):
        super().__init__(*args, **kwargs)
        self.tls = tls

    def channel(self, address: str) -> grpc.Channel:
        return sync_channel(address, tls_ca_file=str(self.tls.ca))

    def wait_registered(self, timeout: float = 60.0) -> None:
        with self.channel(self.router.address) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            wait_until(lambda: stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=5).status == health_pb2.HealthCheckResponse.SERVING,
                       timeout, "the workers registered with the router", interval=0.2)

    def worker_stats(self, proc: Proc) -> pb.WorkerStats:
        with self.channel(proc.address) as channel:
            stub = (pb_grpc.DecodeWorkerStub if proc in self.decode else pb_grpc.PrefillWorkerStub)(channel)
            return stub.Stats(pb.StatsRequest(), metadata=SECRET_MD, timeout=10)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory) -> Iterator[SecureCluster]:
    directory = tmp_path_factory.mktemp("secure")
    tls = make_tls(directory)
    secret_file = directory / "cluster.secret"
    secret_file.write_text(SECRET + "\n")
    security = {"shared_secret_file": str(secret_file), "tls_cert_file": str(tls.cert),
                "tls_key_file": str(tls.key), "tls_ca_file": str(tls.ca)}
    config = write_config(directory / "config.yaml", "tcp", security=security, router={"api_keys": [API_KEY]})
    with SecureCluster(config, num_prefill=1, num_decode=1, register=True, tls=tls) as c:
        yield c


def _generate(cluster: SecureCluster, **kwargs) -> dict:
    return generate_via_router(cluster.router.address, PROMPT, SamplingParams(max_tokens=MAX_NEW),
                               tls_ca_file=str(cluster.tls.ca), **kwargs)


def _code(method, *args, **kwargs) -> grpc.StatusCode:
    """Status of one call of `method` (a unary or server-streaming stub method), read to the end."""
    try:
        result = method(*args, **kwargs)
        for _ in result if hasattr(result, "__next__") else ():
            pass
    except grpc.RpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


def _wait_for_lines(proc: Proc, text: str, count: int, timeout: float = 10.0) -> list[str]:
    def matching() -> list[str]:
        return [line for line in list(proc.log_lines) if text in line]

    wait_until(lambda: len(matching()) >= count, timeout, f"{count} log lines with {text!r}")
    lines = matching()
    assert len(lines) == count, lines
    return lines


def test_request_over_tls_with_secret_matches_hf(cluster, hf_greedy):
    result = _generate(cluster, api_key=API_KEY)
    assert result["token_ids"] == hf_greedy(tuple(result["prompt_token_ids"]), MAX_NEW)
    # the public API answers to API keys only: no key, or the cluster secret in its place, is refused
    for key in ("", SECRET):
        with pytest.raises(RouterError) as info:
            _generate(cluster, api_key=key)
        assert info.value.code == "UNAUTHENTICATED"
    cluster.assert_no_leaked_blocks()


def test_plaintext_clients_are_refused_and_https_works(cluster):
    for address in (cluster.router.address, cluster.prefill[0].address, cluster.decode[0].address):
        with grpc.insecure_channel(address) as channel:
            code = _code(health_pb2_grpc.HealthStub(channel).Check, health_pb2.HealthCheckRequest(), timeout=5)
        assert code == grpc.StatusCode.UNAVAILABLE, address
    port = cluster.router.ready["http_port"]
    request = urllib.request.Request(f"https://127.0.0.1:{port}/v1/models", headers={"Authorization": f"Bearer {API_KEY}"})
    with urllib.request.urlopen(request, context=ssl.create_default_context(cafile=str(cluster.tls.ca)), timeout=10) as response:
        models = json.load(response)
    assert response.status == 200 and models["data"][0]["id"] == "smollm2-135m"
    with pytest.raises(urllib.error.URLError):  # a client that does not trust the CA
        urllib.request.urlopen(request, context=ssl.create_default_context(), timeout=10)
    with pytest.raises((OSError, http.client.HTTPException)):  # plain HTTP on the HTTPS port
        urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=10)
    cluster.assert_no_leaked_blocks()


def test_stranger_cannot_register(cluster):
    stranger = pb.WorkerInfo(worker_id="stranger", role=pb.ROLE_DECODE, address="127.0.0.1:1", model="smollm2-135m")
    with cluster.channel(cluster.router.address) as channel:  # the public port has no Registry at all, secret or not
        for metadata in (None, SECRET_MD):
            code = _code(pb_grpc.RegistryStub(channel).Register, pb.RegisterRequest(worker=stranger), metadata=metadata, timeout=10)
            assert code == grpc.StatusCode.UNIMPLEMENTED
    with cluster.channel(cluster.router.ready["internal_address"]) as channel:  # the CA is public: TLS alone is no credential
        registry = pb_grpc.RegistryStub(channel)
        for metadata in (None, WRONG_MD):
            refused = pb.RegisterRequest(worker=stranger)
            assert _code(registry.Register, refused, metadata=metadata, timeout=10) == grpc.StatusCode.UNAUTHENTICATED
            leave = pb.DeregisterRequest(worker_id=cluster.decode[0].ready["worker_id"])  # evict a real worker
            assert _code(registry.Deregister, leave, metadata=metadata, timeout=10) == grpc.StatusCode.UNAUTHENTICATED
        # with the secret, the registry confirms: the stranger is unknown, the real decode worker is still there
        assert not registry.Heartbeat(pb.HeartbeatRequest(worker_id="stranger"), metadata=SECRET_MD, timeout=10).known
        assert registry.Heartbeat(pb.HeartbeatRequest(worker_id=cluster.decode[0].ready["worker_id"]),
                                  metadata=SECRET_MD, timeout=10).known
    assert _generate(cluster, api_key=API_KEY)["token_ids"]
    cluster.assert_no_leaked_blocks()


def test_worker_rpcs_need_the_secret(cluster):
    sampling = sampling_to_proto(SamplingParams(max_tokens=2))
    for proc, stub_cls in ((cluster.prefill[0], pb_grpc.PrefillWorkerStub), (cluster.decode[0], pb_grpc.DecodeWorkerStub)):
        with cluster.channel(proc.address) as channel:
            stub = stub_cls(channel)
            if stub_cls is pb_grpc.PrefillWorkerStub:
                work = (stub.Prefill, pb.PrefillRequest(request_id="x", token_ids=[1, 2, 3], sampling=sampling))
            else:
                work = (stub.Decode, pb.DecodeRequest(request_id="x", token_ids=[1, 2, 3], sampling=sampling, local_prefill=True))
            for metadata in (None, WRONG_MD):
                for method, request in ((stub.Stats, pb.StatsRequest()), work):
                    assert _code(method, request, metadata=metadata, timeout=10) == grpc.StatusCode.UNAUTHENTICATED, proc.name
            health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
            assert health.status == health_pb2.HealthCheckResponse.SERVING  # health stays open
            assert stub.Stats(pb.StatsRequest(), metadata=SECRET_MD, timeout=10).worker_id == proc.ready["worker_id"]
    cluster.assert_no_leaked_blocks()


def push_kv_is_refused(endpoint: KVEndpoint, header: TransferHeader, secret: str) -> None:
    """Push a whole zero KV transfer signed with `secret`: the receiver must refuse it."""
    zeros = torch.zeros(header.num_tokens, SMOLLM2["num_kv_heads"], SMOLLM2["head_dim"])
    sender = KVSender(connect_timeout=5.0, ack_timeout=20.0, secret=secret)
    try:
        xfer = sender.begin(endpoint, header)
        for layer in range(SMOLLM2["num_layers"]):
            xfer.send_layer(layer, zeros, zeros)
        xfer.finish(first_token=7)
        with pytest.raises(AuthenticationFailed):
            xfer.result(timeout=20)
    finally:
        sender.close()


def test_kv_push_with_wrong_secret_is_refused(cluster, hf_greedy):
    """A stranger who even knows a live transfer id cannot land KV in the decode worker's blocks."""
    decode = cluster.decode[0]
    prompt = list(range(100, 140))
    with cluster.channel(decode.address) as channel:
        call = pb_grpc.DecodeWorkerStub(channel).Decode(
            pb.DecodeRequest(request_id="victim", token_ids=prompt, sampling=sampling_to_proto(SamplingParams(max_tokens=2))),
            metadata=SECRET_MD, timeout=60,
        )
        destination = next(call).admission.kv_destination
        endpoint = KVEndpoint(destination.endpoint.host, destination.endpoint.port, destination.endpoint.transport)
        header = TransferHeader(destination.transfer_id, destination.model_fingerprint, len(prompt), **SMOLLM2)
        for secret in (WRONG, ""):
            push_kv_is_refused(endpoint, header, secret)
        call.cancel()  # the victim gives up; its blocks are freed
    refusals = _wait_for_lines(decode, "refusing KV transfer", 2)
    assert all(destination.transfer_id in line for line in refusals)
    result = _generate(cluster, api_key=API_KEY)  # the receiver keeps serving the real prefill worker
    assert result["token_ids"] == hf_greedy(tuple(result["prompt_token_ids"]), MAX_NEW)
    cluster.assert_no_leaked_blocks()

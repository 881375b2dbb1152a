"""Security without processes: config validation, the secret check on gRPC services (in-process
servers on 127.0.0.1), TLS, the KV handshake proof (wire level and a real receiver and sender over
local, tcp and ucx), and loopback-only binds by default."""

from __future__ import annotations

import asyncio
import datetime
import importlib.util
import ipaddress
import json
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
import torch
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common.config import ConfigError, SecurityConfig, config_from_dict
from common.secrets import SECRET_ENV, HandedSecret
from common.security import InsecureBind, Security, sync_channel
from common.serving import create_server
from engine.kv_cache import KVCache, KVLayout
from kvtransfer import (
    AuthenticationFailed,
    KVReceiver,
    KVSender,
    TransferHeader,
    fingerprint,
)
from kvtransfer.wire import sign_begin, verify_begin
from proto.pdserve.v1 import pdserve_pb2 as pb
from proto.pdserve.v1 import pdserve_pb2_grpc as pb_grpc
from router.pool import WorkerPool
from router.registry_service import RegistryService

pytestmark = pytest.mark.timeout(60)

SECRET = "s3cret-for-tests-0123456789"
WRONG = "not-the-secret-0123456789"


# --- TLS material ---------------------------------------------------------------------------


@dataclass(frozen=True)
class TLSFiles:
    ca: Path
    cert: Path
    key: Path


def make_tls(directory: Path, names: tuple[str, ...] = ("localhost", "pdserve.internal")) -> TLSFiles:
    """A self-signed CA and a server certificate it signed, valid for 127.0.0.1 and `names`."""
    now = datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "pdserve test CA")])
    ca_cert = (
        x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    sans = [x509.IPAddress(ipaddress.ip_address("127.0.0.1")), *(x509.DNSName(n) for n in names)]
    cert = (
        x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, names[0])]))
        .issuer_name(ca_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName(sans), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    files = TLSFiles(directory / "ca.pem", directory / "server.pem", directory / "server.key")
    files.ca.write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
    files.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    files.key.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    return files


@pytest.fixture(scope="module")
def tls_files(tmp_path_factory) -> TLSFiles:
    return make_tls(tmp_path_factory.mktemp("tls"))


# --- config ---------------------------------------------------------------------------------


def test_defaults_bind_loopback_and_have_no_secret(monkeypatch):
    from common.worker import parse_args

    monkeypatch.delenv(SECRET_ENV, raising=False)
    config = config_from_dict({})
    assert config.router.host == "127.0.0.1"
    assert config.kv_transfer.host == "127.0.0.1"
    assert parse_args("decode", []).host == "127.0.0.1"
    security = Security.from_config(config.security)
    assert not security.secret and not security.tls and security.server_interceptors(["pdserve.v1.DecodeWorker"]) == []


def test_secret_sources_in_order(tmp_path, monkeypatch):
    secret_file = tmp_path / "secret"
    secret_file.write_text(f"  {SECRET}\n")
    monkeypatch.setenv(SECRET_ENV, "from-the-environment-0123")
    from_env = config_from_dict({}).security
    assert Security.from_config(from_env).secret == "from-the-environment-0123"
    from_file = config_from_dict({"security": {"shared_secret_file": str(secret_file)}}).security
    assert Security.from_config(from_file).secret == SECRET
    inline = config_from_dict({"security": {"shared_secret": WRONG}}).security
    assert Security.from_config(inline).secret == WRONG
    assert SECRET not in repr(config_from_dict({"security": {"shared_secret": SECRET}}))


@pytest.mark.parametrize(
    ("section", "field"),
    [
        ({"shared_secret": "short"}, "security.shared_secret"),
        ({"shared_secret": 12345678901234567}, "security.shared_secret"),
        ({"shared_secret": SECRET, "shared_secret_file": "/x"}, "security.shared_secret_file"),
        ({"shared_secret_file": "/nonexistent/secret"}, "security.shared_secret_file"),
        ({"tls_cert_file": "CERT"}, "security.tls_key_file"),
        ({"tls_key_file": "KEY"}, "security.tls_cert_file"),
        ({"tls_cert_file": "/nonexistent.pem", "tls_key_file": "KEY"}, "security.tls_cert_file"),
        ({"tls_cert_file": "CERT", "tls_key_file": "NOTPEM"}, "security.tls_key_file"),
        ({"tls_ca_file": "CA"}, "security.tls_ca_file"),
        ({"tls_server_name": "pdserve.internal"}, "security.tls_server_name"),
        ({"tls": True}, "security.tls"),
        ({"allow_unauthenticated": "yes"}, "security.allow_unauthenticated"),
    ],
)
def test_bad_security_config_names_the_field(section, field, tls_files, tmp_path, monkeypatch):
    monkeypatch.delenv(SECRET_ENV, raising=False)
    not_pem = tmp_path / "not.pem"
    not_pem.write_text("hello")
    paths = {"CERT": str(tls_files.cert), "KEY": str(tls_files.key), "CA": str(tls_files.ca), "NOTPEM": str(not_pem)}
    section = {k: paths.get(v, v) if isinstance(v, str) else v for k, v in section.items()}
    with pytest.raises(ConfigError) as info:
        config_from_dict({"security": section})
    assert info.value.field == field


def test_short_secret_in_the_environment_is_refused(monkeypatch):
    monkeypatch.setenv(SECRET_ENV, "short")
    with pytest.raises(ConfigError) as info:
        config_from_dict({})
    assert info.value.field == SECRET_ENV


def test_tls_config_loads(tls_files):
    section = {"tls_cert_file": str(tls_files.cert), "tls_key_file": str(tls_files.key), "tls_ca_file": str(tls_files.ca)}
    security = Security.from_config(config_from_dict({"security": section}).security)
    assert security.tls and security.uvicorn_ssl() == {"ssl_certfile": str(tls_files.cert), "ssl_keyfile": str(tls_files.key)}


# --- gRPC: the secret check and TLS ---------------------------------------------------------


class EchoDecode(pb_grpc.DecodeWorkerServicer):
    """A DecodeWorker that answers Stats and streams two messages per Decode (no engine)."""

    async def Decode(self, request, context):
        for _ in range(2):
            yield pb.DecodeResponse(request_id=request.request_id)

    async def Stats(self, request, context):
        return pb.WorkerStats(worker_id="echo")


@pytest.fixture
async def servers(tls_files):
    """A 'worker' (DecodeWorker protected) and a 'router' (Registry protected) with the secret;
    the router also serves TLS."""
    worker_sec = Security(secret=SECRET)
    worker, worker_port, worker_health = create_server("127.0.0.1", 0, ["pdserve.v1.DecodeWorker"], worker_sec,
                                                       protected=["pdserve.v1.DecodeWorker"])
    pb_grpc.add_DecodeWorkerServicer_to_server(EchoDecode(), worker)
    tls_sec = Security.from_config(SecurityConfig(shared_secret=SECRET, tls_cert_file=str(tls_files.cert),
                                                  tls_key_file=str(tls_files.key), tls_ca_file=str(tls_files.ca)))
    pool = WorkerPool()
    router, router_port, _ = create_server("127.0.0.1", 0, ["pdserve.v1.Registry"], tls_sec, protected=["pdserve.v1.Registry"])
    pb_grpc.add_RegistryServicer_to_server(RegistryService(pool), router)
    await worker.start()
    await router.start()
    await worker_health.set("", health_pb2.HealthCheckResponse.SERVING)
    yield f"127.0.0.1:{worker_port}", f"127.0.0.1:{router_port}", tls_sec, pool
    await worker.stop(None)
    await router.stop(None)
    await pool.close()


async def _code_of(method, *args, **kwargs) -> grpc.StatusCode:
    try:
        result = method(*args, **kwargs)
        if hasattr(result, "read"):
            while await result.read() is not grpc.aio.EOF:
                pass
        else:
            await result
    except grpc.aio.AioRpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


async def test_worker_refuses_calls_without_the_secret(servers):
    worker_addr, _, _, _ = servers
    async with grpc.aio.insecure_channel(worker_addr) as channel:
        stub = pb_grpc.DecodeWorkerStub(channel)
        for metadata in (None, (("x-pdserve-secret", WRONG),), (("x-pdserve-secret", ""),)):
            for method, request in ((stub.Stats, pb.StatsRequest()), (stub.Decode, pb.DecodeRequest())):
                assert await _code_of(method, request, metadata=metadata, timeout=5) == grpc.StatusCode.UNAUTHENTICATED
        health = health_pb2_grpc.HealthStub(channel)  # health stays open
        reply = await health.Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING


async def test_secret_channel_reaches_unary_and_streaming_methods(servers):
    worker_addr, _, _, _ = servers
    channel = Security(secret=SECRET).channel(worker_addr)
    try:
        stub = pb_grpc.DecodeWorkerStub(channel)
        assert (await stub.Stats(pb.StatsRequest(), timeout=5)).worker_id == "echo"
        call = stub.Decode(pb.DecodeRequest(request_id="r1"), timeout=5)  # read() as the router does
        messages = []
        while (message := await call.read()) is not grpc.aio.EOF:
            messages.append(message.request_id)
        assert messages == ["r1", "r1"]
    finally:
        await channel.close()


async def test_stranger_cannot_register_with_the_router(servers):
    _, router_addr, tls_sec, pool = servers
    info = pb.WorkerInfo(worker_id="stranger", role=pb.ROLE_DECODE, address="127.0.0.1:1")
    stranger = Security(tls_cert=tls_sec.tls_cert, tls_key=tls_sec.tls_key, tls_ca=tls_sec.tls_ca)  # TLS, no secret
    for security in (stranger, Security(secret=WRONG, tls_cert=tls_sec.tls_cert, tls_key=tls_sec.tls_key, tls_ca=tls_sec.tls_ca)):
        channel = security.channel(router_addr)
        stub = pb_grpc.RegistryStub(channel)
        assert await _code_of(stub.Register, pb.RegisterRequest(worker=info), timeout=5) == grpc.StatusCode.UNAUTHENTICATED
        assert await _code_of(stub.Deregister, pb.DeregisterRequest(worker_id="x"), timeout=5) == grpc.StatusCode.UNAUTHENTICATED
        await channel.close()
    assert "stranger" not in pool.workers
    channel = tls_sec.channel(router_addr)  # the cluster's own channel: TLS + secret
    await pb_grpc.RegistryStub(channel).Register(pb.RegisterRequest(worker=info), timeout=5)
    await channel.close()
    assert "stranger" in pool.workers


async def test_a_live_worker_id_stays_at_its_address(servers):
    _, router_addr, tls_sec, pool = servers
    channel = tls_sec.channel(router_addr)
    registry = pb_grpc.RegistryStub(channel)

    def register(address: str):
        return _code_of(registry.Register, pb.RegisterRequest(worker=pb.WorkerInfo(worker_id="d1", role=pb.ROLE_DECODE,
                                                                                   address=address)), timeout=5)
    try:
        assert await register("127.0.0.1:1001") == grpc.StatusCode.OK
        assert await register("127.0.0.1:1001") == grpc.StatusCode.OK  # the same worker again (router restart)
        assert await register("127.0.0.1:6666") == grpc.StatusCode.ALREADY_EXISTS  # someone else, same id
        assert pool.workers["d1"].address == "127.0.0.1:1001"
        pool.workers["d1"].last_seen -= pool.heartbeat_timeout_s + 1  # silent past the timeout: the id is free
        assert await register("127.0.0.1:2002") == grpc.StatusCode.OK
        assert pool.workers["d1"].address == "127.0.0.1:2002"
    finally:
        await channel.close()


def test_without_a_secret_only_loopback_binds(caplog):
    open_ = Security()
    open_.require_secret_for(["127.0.0.1", "::1", "localhost", "127.0.0.2"], False, "router")
    for host in ("10.0.0.5", "0.0.0.0", "node-1.internal"):
        with pytest.raises(InsecureBind, match="security.shared_secret"):
            open_.require_secret_for(["127.0.0.1", host], False, "router")
    assert not caplog.records
    open_.require_secret_for(["10.0.0.5"], True, "router")  # allowed, and said loudly
    assert [r.levelname for r in caplog.records] == ["WARNING"] and "WITHOUT a cluster secret" in caplog.text
    Security(secret=SECRET).require_secret_for(["10.0.0.5"], False, "router")


def test_handed_secret_never_prints_itself():
    handed = HandedSecret(SECRET)
    assert SECRET not in repr(handed) and SECRET not in str(handed) and SECRET not in f"{handed} {[handed]}"
    assert Security.from_config(SecurityConfig(), handed.value).secret == SECRET
    assert Security.from_config(SecurityConfig(shared_secret=WRONG), handed.value).secret == WRONG  # configured wins


async def test_tls_router_refuses_plaintext_and_unknown_ca(servers, tmp_path):
    _, router_addr, _, _ = servers
    async with grpc.aio.insecure_channel(router_addr) as channel:
        code = await _code_of(health_pb2_grpc.HealthStub(channel).Check, health_pb2.HealthCheckRequest(), timeout=3)
    assert code == grpc.StatusCode.UNAVAILABLE
    other = make_tls(tmp_path)  # a certificate chain the router's does not belong to
    channel = Security(secret=SECRET, tls_cert=other.cert.read_bytes(), tls_key=other.key.read_bytes(),
                       tls_ca=other.ca.read_bytes()).channel(router_addr)
    code = await _code_of(pb_grpc.RegistryStub(channel).Heartbeat, pb.HeartbeatRequest(worker_id="x"), timeout=3)
    await channel.close()
    assert code == grpc.StatusCode.UNAVAILABLE


async def test_sync_channel_with_ca_and_server_name(servers, tls_files):
    _, router_addr, _, _ = servers
    port = router_addr.rsplit(":", 1)[1]

    def heartbeat(metadata=None):
        # dial "127.0.0.1" but expect the certificate's DNS name, as a multi-node cluster would
        with sync_channel(f"127.0.0.1:{port}", tls_ca_file=str(tls_files.ca), tls_server_name="pdserve.internal") as channel:
            try:
                return pb_grpc.RegistryStub(channel).Heartbeat(pb.HeartbeatRequest(worker_id="x"), metadata=metadata, timeout=5)
            except grpc.RpcError as exc:
                return exc.code()

    assert await asyncio.to_thread(heartbeat) == grpc.StatusCode.UNAUTHENTICATED  # through TLS; no secret
    reply = await asyncio.to_thread(heartbeat, Security(secret=SECRET).call_metadata())
    assert reply.known is False


# --- KV handshake ---------------------------------------------------------------------------

LAYOUT = KVLayout(num_layers=3, num_kv_heads=2, head_dim=8, block_size=4, dtype=torch.float32)
FP = fingerprint(LAYOUT, json.dumps({"model_type": "tiny"}))
N = 10
DST = [3, 4, 9]


def test_begin_proof_binds_the_header_and_the_secret():
    body = TransferHeader.for_layout("t1", LAYOUT, N, FP).encode()
    signed = sign_begin(body, SECRET.encode())
    assert sign_begin(body, b"") == body
    assert SECRET.encode() not in signed
    assert TransferHeader.decode(signed) == TransferHeader.decode(body)  # receivers without a secret ignore it
    assert verify_begin(signed, SECRET.encode()) is None
    assert verify_begin(signed, b"") is None
    assert "different shared secret" in verify_begin(signed, WRONG.encode())
    assert "no authentication" in verify_begin(body, SECRET.encode())
    other = TransferHeader.for_layout("t2", LAYOUT, N, FP).encode()
    spliced = other + signed[len(body):]  # t1's proof on t2's header
    assert "different shared secret" in verify_begin(spliced, SECRET.encode())
    assert "malformed" in verify_begin(body + b"\x00\x00", SECRET.encode())


HAVE_UCX = importlib.util.find_spec("ucxx") is not None
TRANSPORTS = ["local", "tcp", pytest.param("ucx", marks=pytest.mark.skipif(not HAVE_UCX, reason="ucxx missing"))]


def _source() -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(3)
    shape = (N, LAYOUT.num_kv_heads, LAYOUT.head_dim)
    return [(torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)) for _ in range(LAYOUT.num_layers)]


async def _push(sender: KVSender, endpoint, tid: str, layers) -> None:
    xfer = sender.begin(endpoint, TransferHeader.for_layout(tid, LAYOUT, N, FP))
    for i, (k, v) in enumerate(layers):
        xfer.send_layer(i, k, v)
    xfer.finish(first_token=42)
    await xfer.wait(10)


def _blocks_untouched(cache: KVCache) -> bool:
    return all(not cache.key_caches[i][DST].any() and not cache.value_caches[i][DST].any() for i in range(LAYOUT.num_layers))


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_receiver_refuses_kv_without_the_secret(transport):
    cache = KVCache(LAYOUT, num_blocks=12)
    layers = _source()
    async with KVReceiver(cache, transport, secret=SECRET, settle_timeout=2.0) as receiver:
        fut = receiver.expect("t1", DST, N, FP, timeout=20)
        for secret in (WRONG, ""):  # a stranger that knows the transfer id, with a wrong or no secret
            sender = KVSender(connect_timeout=5.0, ack_timeout=10.0, secret=secret)
            try:
                with pytest.raises(AuthenticationFailed, match="shared secret"):
                    await _push(sender, receiver.endpoint, "t1", layers)
            finally:
                await asyncio.to_thread(sender.close)
        assert receiver.stats.failed["UNAUTHENTICATED"] == 2
        assert not fut.done() and receiver.pending == 1 and _blocks_untouched(cache)
        sender = KVSender(connect_timeout=5.0, ack_timeout=10.0, secret=SECRET)  # the real prefill worker
        try:
            await _push(sender, receiver.endpoint, "t1", layers)
        finally:
            await asyncio.to_thread(sender.close)
        received = await asyncio.wait_for(fut, 10)
    assert received.first_token == 42 and receiver.stats.completed == 1
    k, v = cache.read_tokens(0, DST, N)
    assert torch.equal(k, layers[0][0]) and torch.equal(v, layers[0][1])

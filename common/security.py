"""Cluster security: the shared secret on internal RPCs and optional TLS, in one place.

Lifecycle: every process (router, prefill and decode workers, their Ray actors) builds one
`Security` from `config.security` at start (`Security.from_config`: the secret is resolved here,
from the YAML value, the secret file or the environment variable PDSERVE_SHARED_SECRET, and the
TLS files are read once) and uses it for everything that crosses the network inside the cluster:

  `security.channel(address)`   an async client channel to a worker or to the router's Registry:
                                TLS when a certificate is configured (verified against `tls_ca_file`),
                                and the secret attached as metadata to every call
  `security.add_port(server, address)`        bind a server port, TLS when configured
  `security.server_interceptors(services)`    refuse calls to `services` that lack the secret
                                              (UNAUTHENTICATED); other services (health, reflection,
                                              the public Router) are untouched
  `security.kv_secret`          key the KV sender signs its transfer headers with and the
                                KV receiver checks them with (kvtransfer.wire.sign_begin)
  `security.uvicorn_ssl()`      ssl_certfile / ssl_keyfile for the router's HTTP server

With no secret and no certificate every helper degrades to plaintext, unauthenticated calls; a
process may then bind loopback addresses only (`security.require_secret_for`) unless the config says
`security.allow_unauthenticated: true`. Under Ray a deployment always has a secret: the configured
one, else one the controller generates and hands to its actors (`from_config(..., handed=...)`).
The public API (Router/Generate, HTTP /v1) is governed by API keys, never by the secret, and API
keys never open an internal service.
"""

from __future__ import annotations

import hmac
import ipaddress
import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from common.secrets import resolve_secret

log = logging.getLogger(__name__)

SECRET_METADATA_KEY = "x-pdserve-secret"
"""gRPC metadata key that carries the shared secret on internal calls."""
REFUSAL = "missing or wrong cluster secret (metadata 'x-pdserve-secret'; see security.shared_secret)"
MAX_MESSAGE_BYTES = 64 << 20
INTERNAL_CHANNEL_OPTIONS = (
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    # a restarted router or worker is back within a second or two: redial at most 1 s apart,
    # not with gRPC's default backoff that grows to minutes
    ("grpc.initial_reconnect_backoff_ms", 250),
    ("grpc.min_reconnect_backoff_ms", 250),
    ("grpc.max_reconnect_backoff_ms", 1000),
)


def _read_optional(path: str) -> bytes | None:
    return Path(path).read_bytes() if path else None


@dataclass(frozen=True)
class Security:
    """Secret and TLS material of one process. Build with `from_config`; `Security()` is off."""

    secret: str = field(default="", repr=False)
    tls_cert: bytes | None = field(default=None, repr=False)
    tls_key: bytes | None = field(default=None, repr=False)
    tls_ca: bytes | None = field(default=None, repr=False)
    tls_cert_file: str = ""
    tls_key_file: str = ""
    tls_server_name: str = ""
    """Name the clients expect in the servers' certificate, whatever address they dial."""

    @classmethod
    def from_config(cls, config: Any, handed: str = "") -> Security:
        """From a `common.config.SecurityConfig` (duck-typed: anything with its fields); `handed`:
        the deployment's generated secret, given by the host (a Ray actor) when none is configured."""
        return cls(
            secret=resolve_secret(config.shared_secret, config.shared_secret_file) or handed,
            tls_cert=_read_optional(config.tls_cert_file),
            tls_key=_read_optional(config.tls_key_file),
            tls_ca=_read_optional(config.tls_ca_file),
            tls_cert_file=config.tls_cert_file,
            tls_key_file=config.tls_key_file,
            tls_server_name=config.tls_server_name,
        )

    @property
    def tls(self) -> bool:
        return self.tls_cert is not None and self.tls_key is not None

    @property
    def kv_secret(self) -> bytes:
        return self.secret.encode()

    # --- clients ---------------------------------------------------------------------------

    def channel(self, address: str, options: Iterable[tuple[str, Any]] = ()) -> grpc.aio.Channel:
        """Async channel for internal calls (router -> worker, worker -> Registry)."""
        opts = [*INTERNAL_CHANNEL_OPTIONS, *options]
        interceptors = secret_client_interceptors(self.secret) if self.secret else None
        if not self.tls:
            return grpc.aio.insecure_channel(address, options=opts, interceptors=interceptors)
        if self.tls_server_name:
            opts.append(("grpc.ssl_target_name_override", self.tls_server_name))
        credentials = grpc.ssl_channel_credentials(root_certificates=self.tls_ca)
        return grpc.aio.secure_channel(address, credentials, options=opts, interceptors=interceptors)

    def call_metadata(self) -> tuple[tuple[str, str], ...]:
        """Metadata to attach by hand (sync clients, tests); empty without a secret."""
        return ((SECRET_METADATA_KEY, self.secret),) if self.secret else ()

    # --- servers ---------------------------------------------------------------------------

    def add_port(self, server: grpc.aio.Server, address: str) -> int:
        """Bind `address` on `server` (TLS when configured); the bound port, 0 on failure."""
        if not self.tls:
            return server.add_insecure_port(address)
        credentials = grpc.ssl_server_credentials([(self.tls_key, self.tls_cert)])
        return server.add_secure_port(address, credentials)

    def server_interceptors(self, protected_services: Iterable[str]) -> list[grpc.aio.ServerInterceptor]:
        """Interceptors that refuse calls to `protected_services` without the secret."""
        services = frozenset(protected_services)
        return [SecretCheck(self.secret, services)] if self.secret and services else []

    def require_secret_for(self, hosts: Iterable[str], allow_unauthenticated: bool, who: str) -> None:
        """Refuse (InsecureBind) to serve a non-loopback address without a secret, unless allowed,
        and then say so loudly: anyone who reaches such a port could join or call the cluster."""
        if self.secret:
            return
        exposed = sorted({h for h in hosts if not is_loopback(h)})
        if allow_unauthenticated:
            log.warning("%s runs WITHOUT a cluster secret (security.allow_unauthenticated: true): any process that "
                        "reaches %s can register as a worker or call the workers", who, ", ".join(exposed) or "its ports")
            return
        if exposed:
            raise InsecureBind(f"security.shared_secret: {who} would serve {', '.join(exposed)} without a cluster secret; "
                               "set security.shared_secret_file (or PDSERVE_SHARED_SECRET), bind 127.0.0.1, or set "
                               "security.allow_unauthenticated: true to accept the risk")

    def uvicorn_ssl(self) -> dict[str, str]:
        """uvicorn.Config keyword arguments for HTTPS; empty without TLS."""
        return {"ssl_certfile": self.tls_cert_file, "ssl_keyfile": self.tls_key_file} if self.tls else {}


class InsecureBind(ValueError):
    """A non-loopback bind without a cluster secret (see `Security.require_secret_for`)."""


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_secret(expected: str, presented: str | bytes | None) -> bool:
    """Constant-time comparison of a presented secret with the expected one."""
    if presented is None:
        return False
    raw = presented if isinstance(presented, bytes) else presented.encode()
    return hmac.compare_digest(raw, expected.encode())


class SecretCheck(grpc.aio.ServerInterceptor):
    """Server side: calls to a protected service must carry the secret, else UNAUTHENTICATED.

    The refusal happens before the request is deserialized or reaches the servicer."""

    def __init__(self, secret: str, protected_services: frozenset[str]):
        self._secret = secret
        self._protected = protected_services

    async def intercept_service(self, continuation, handler_call_details: grpc.HandlerCallDetails):
        handler = await continuation(handler_call_details)
        if handler is None or _service_of(handler_call_details.method) not in self._protected:
            return handler
        presented = dict(handler_call_details.invocation_metadata or ()).get(SECRET_METADATA_KEY)
        if check_secret(self._secret, presented):
            return handler
        log.warning("refused %s: %s", handler_call_details.method, REFUSAL)
        return _refusal(handler)


def _service_of(method: str) -> str:
    """'/pdserve.v1.Registry/Register' -> 'pdserve.v1.Registry'."""
    return method.lstrip("/").partition("/")[0]


def _refusal(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler of the same kind as `handler` that answers UNAUTHENTICATED (request left raw)."""

    async def refuse(request, context) -> None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, REFUSAL)

    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(refuse)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(refuse)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(refuse)
    return grpc.stream_stream_rpc_method_handler(refuse)


class _AttachSecret:
    """Client side: add the secret to the call's metadata (one subclass per call kind, since a
    grpc.aio channel files each interceptor under one kind only)."""

    def __init__(self, secret: str):
        self._secret = secret

    def _with_secret(self, details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        metadata = grpc.aio.Metadata(*(tuple(details.metadata) if details.metadata else ()))
        metadata.add(SECRET_METADATA_KEY, self._secret)
        return details._replace(metadata=metadata)


class _UnaryUnary(_AttachSecret, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation, client_call_details, request):
        return await continuation(self._with_secret(client_call_details), request)


class _UnaryStream(_AttachSecret, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation, client_call_details, request):
        return await continuation(self._with_secret(client_call_details), request)


class _StreamUnary(_AttachSecret, grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(self, continuation, client_call_details, request_iterator):
        return await continuation(self._with_secret(client_call_details), request_iterator)


class _StreamStream(_AttachSecret, grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation, client_call_details, request_iterator):
        return await continuation(self._with_secret(client_call_details), request_iterator)


def secret_client_interceptors(secret: str) -> list[Any]:
    return [cls(secret) for cls in (_UnaryUnary, _UnaryStream, _StreamUnary, _StreamStream)]


def sync_channel(address: str, tls: bool = False, tls_ca_file: str = "", tls_server_name: str = "") -> grpc.Channel:
    """Blocking channel for command-line clients: TLS when `tls` or a `tls_ca_file` is given
    (the server's certificate verified against that CA, else the system roots), else plaintext."""
    options = [("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)]
    if not (tls or tls_ca_file):
        return grpc.insecure_channel(address, options=options)
    if tls_server_name:
        options.append(("grpc.ssl_target_name_override", tls_server_name))
    roots = Path(tls_ca_file).read_bytes() if tls_ca_file else None
    credentials = grpc.ssl_channel_credentials(root_certificates=roots)
    return grpc.secure_channel(address, credentials, options=options)

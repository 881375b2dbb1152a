"""Tracing (common/tracing.py): config -> provider, span helpers, W3C context in gRPC metadata, exporters.

The process's global tracer provider can be installed once: this module installs one built by
`build_provider` with the SDK's in-memory exporter and reads the finished spans back from it. That
tracing off installs nothing and costs no-op spans is checked in a fresh interpreter.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import textwrap

import grpc
import pytest
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import ConsoleSpanExporter
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from bench.cluster import REPO
from common.config import TracingConfig, config_from_dict
from common.tracing import (
    JsonLinesSpanExporter,
    build_provider,
    context_from,
    context_of,
    fail,
    http_context,
    make_exporter,
    outgoing_metadata,
    server_span,
    span,
)
from common.validation import ConfigError

ENABLED = TracingConfig(enabled=True, service_name="pdtest")


class FakeServicerContext:
    """What `server_span` reads of a grpc.aio.ServicerContext: metadata, and the status an abort set."""

    def __init__(self, metadata=(), code: grpc.StatusCode | None = None, details: str = ""):
        self._metadata, self._code, self._details = tuple(metadata), code, details

    def invocation_metadata(self):
        return self._metadata

    def code(self):
        return self._code

    def details(self):
        return self._details


@pytest.fixture(scope="module")
def installed():
    """The in-memory exporter behind the process's tracer provider (installed here, once)."""
    memory = InMemorySpanExporter()
    provider = build_provider(ENABLED, "router", "router-7", exporter=memory)
    trace.set_tracer_provider(provider)
    assert trace.get_tracer_provider() is provider, "another test installed a tracer provider first"
    yield provider, memory
    provider.shutdown()


@pytest.fixture
def finished(installed):
    """Spans finished during the test, by name (the batch processor flushed first)."""
    provider, memory = installed
    memory.clear()

    def read() -> dict:
        provider.force_flush()
        return {s.name: s for s in memory.get_finished_spans()}

    return read


def test_config_section_defaults_and_field_named_errors():
    assert config_from_dict({}).tracing == TracingConfig()
    assert TracingConfig().enabled is False
    loaded = config_from_dict({"tracing": {"enabled": True, "exporter": "file", "directory": "/tmp/t", "sample_ratio": 0.25}}).tracing
    assert (loaded.exporter, loaded.directory, loaded.sample_ratio) == ("file", "/tmp/t", 0.25)
    for bad, field in [({"exporter": "jaeger"}, "tracing.exporter"), ({"sample_ratio": 1.5}, "tracing.sample_ratio"),
                       ({"enabled": "yes"}, "tracing.enabled"), ({"enabled": True, "exporter": "file"}, "tracing.directory"),
                       ({"protocol": "udp"}, "tracing.protocol"), ({"service_name": ""}, "tracing.service_name"),
                       ({"endpont": "x"}, "tracing.endpont")]:
        with pytest.raises(ConfigError) as err:
            config_from_dict({"tracing": bad})
        assert err.value.field == field, (bad, err.value)


def run_fresh(code: str) -> None:
    """`code` in a fresh interpreter (its own global tracer provider); it must print ok."""
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=REPO, capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.stdout.strip() == "ok", done.stderr


def test_disabled_installs_nothing_and_propagates_nothing():
    run_fresh("""
        from opentelemetry import trace
        from opentelemetry.context import Context
        from common.config import TracingConfig
        from common.tracing import context_of, outgoing_metadata, setup_tracing, span
        stop = setup_tracing(TracingConfig(), "router")
        assert type(trace.get_tracer_provider()).__name__ == "ProxyTracerProvider", trace.get_tracer_provider()
        with span("generate", Context(), request_id="r") as root:
            assert not root.is_recording() and not root.get_span_context().is_valid
            assert outgoing_metadata(context_of(root)) == ()
        stop()
        print("ok")
    """)


def test_enabled_installs_the_configured_provider_and_flushes_at_stop(tmp_path):
    run_fresh(f"""
        import json, os, pathlib
        from opentelemetry import trace
        from opentelemetry.context import Context
        from common.config import config_from_dict
        from common.tracing import setup_tracing, span
        config = config_from_dict({{"tracing": {{"enabled": True, "exporter": "file", "directory": "{tmp_path}"}}}})
        stop = setup_tracing(config.tracing, "decode", "decode-3")
        with span("decode", Context(), request_id="r.0"):
            pass
        stop()  # flushes the batch processor
        (line,) = pathlib.Path("{tmp_path}", f"pdserve-decode-{{os.getpid()}}.jsonl").read_text().splitlines()
        exported = json.loads(line)
        assert exported["name"] == "decode" and exported["attributes"] == {{"pdserve.request_id": "r.0"}}, exported
        resource = exported["resource"]["attributes"]
        assert (resource["service.name"], resource["service.instance.id"]) == ("pdserve-decode", "decode-3"), resource
        print("ok")
    """)


def test_span_tree_across_grpc_metadata(finished):
    with span("generate", Context(), SpanKind.SERVER, request_id="r1", prompt_tokens=5, absent=None) as root:
        with span("prefill", context_of(root), SpanKind.CLIENT, attempt=1) as client:
            metadata = outgoing_metadata(context_of(client))
        assert dict(metadata)["traceparent"].split("-")[1] == format(root.get_span_context().trace_id, "032x")
        secret = ("x-pdserve-secret", "s3cret")
        with server_span("prefill.server", FakeServicerContext([secret, *metadata, ("k-bin", b"\x00")]), worker_id="p0"):
            pass
    got = finished()
    root, client, server = got["generate"], got["prefill"], got["prefill.server"]
    assert root.parent is None and root.kind == SpanKind.SERVER
    assert client.parent.span_id == root.context.span_id and client.kind == SpanKind.CLIENT
    assert server.parent.span_id == client.context.span_id and server.parent.is_remote and server.kind == SpanKind.SERVER
    assert len({s.context.trace_id for s in got.values()}) == 1
    assert dict(root.attributes) == {"pdserve.request_id": "r1", "pdserve.prompt_tokens": 5}
    assert server.attributes["pdserve.worker_id"] == "p0"
    assert root.resource.attributes["service.name"] == "pdtest-router"
    assert root.resource.attributes["service.instance.id"] == "router-7"


def test_http_requests_hang_under_the_frameworks_span_else_the_headers(finished):
    header = {"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}
    assert trace.get_current_span(http_context(header)).get_span_context().span_id == 0xb7ad6b7169203331
    with span("POST /v1/completions", Context()) as framework:
        token = otel_context.attach(context_of(framework))  # what FastAPI's telemetry does around the endpoint
        try:
            parent = http_context(header)
        finally:
            otel_context.detach(token)
    assert trace.get_current_span(parent) is framework


def test_errors_set_status_with_the_message(finished):
    with pytest.raises(RuntimeError), span("boom", Context()):
        raise RuntimeError("engine exploded")
    aborted = FakeServicerContext(code=grpc.StatusCode.RESOURCE_EXHAUSTED, details="no free KV blocks")
    with pytest.raises(grpc.aio.AbortError), server_span("decode", aborted):
        raise grpc.aio.AbortError("Locally aborted.")
    rpc_error = grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(), details="worker gone")
    with pytest.raises(grpc.aio.AioRpcError), span("decode.admit", Context()):
        raise rpc_error
    with span("kv.receive", Context()) as kv:
        fail(kv, "checksum mismatch in layer 7")
    with pytest.raises(asyncio.CancelledError), span("prefill", Context()):
        raise asyncio.CancelledError
    got = finished()
    assert got["boom"].status.status_code == StatusCode.ERROR and got["boom"].status.description == "engine exploded"
    assert got["boom"].events[0].name == "exception"
    assert got["decode"].status.description == "RESOURCE_EXHAUSTED: no free KV blocks"
    assert got["decode.admit"].status.description == "UNAVAILABLE: worker gone"
    assert got["kv.receive"].status.description == "checksum mismatch in layer 7"
    assert got["prefill"].status.status_code == StatusCode.UNSET and [e.name for e in got["prefill"].events] == ["cancelled"]


def test_sample_ratio_decides_at_the_root_and_workers_follow_the_parent():
    provider = build_provider(TracingConfig(enabled=True, sample_ratio=0.0), "decode", exporter=InMemorySpanExporter())
    tracer = provider.get_tracer("t")
    assert not tracer.start_span("root").is_recording()
    trace_id, span_id = "0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331"
    sampled = context_from({"traceparent": f"00-{trace_id}-{span_id}-01"})
    child = tracer.start_span("decode", context=sampled)
    assert child.is_recording() and format(child.get_span_context().trace_id, "032x") == trace_id
    assert not tracer.start_span("decode", context=context_from({"traceparent": f"00-{trace_id}-{span_id}-00"})).is_recording()
    provider.shutdown()


def test_file_exporter_writes_one_json_span_per_line(tmp_path):
    config = TracingConfig(enabled=True, exporter="file", directory=str(tmp_path / "traces"))
    exporter = make_exporter(config, "prefill")
    assert isinstance(exporter, JsonLinesSpanExporter)
    provider = TracerProvider()
    tracer = provider.get_tracer("t")
    parent = tracer.start_span("prefill")
    child = tracer.start_span("kv.send", context=trace.set_span_in_context(parent), attributes={"pdserve.kv_bytes": 42})
    child.end()
    parent.end()
    exporter.export([child, parent])
    exporter.shutdown()
    (path,) = (tmp_path / "traces").iterdir()
    assert path.name == f"pdserve-prefill-{os.getpid()}.jsonl"
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [d["name"] for d in lines] == ["kv.send", "prefill"]
    assert lines[0]["parent_id"] == lines[1]["context"]["span_id"] and lines[0]["attributes"] == {"pdserve.kv_bytes": 42}


def test_console_and_otlp_exporters_are_the_sdk_and_contrib_ones():
    assert isinstance(make_exporter(TracingConfig(enabled=True), "router"), ConsoleSpanExporter)
    pytest.importorskip("opentelemetry.exporter.otlp.proto.grpc.trace_exporter")
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter

    grpc_exporter = make_exporter(TracingConfig(enabled=True, exporter="otlp", endpoint="http://127.0.0.1:4317"), "router")
    http_exporter = make_exporter(TracingConfig(enabled=True, exporter="otlp", protocol="http", endpoint="http://127.0.0.1:4318/v1/traces"),
                                  "router")
    assert isinstance(grpc_exporter, GrpcExporter) and isinstance(http_exporter, HttpExporter)
    assert http_exporter._endpoint == "http://127.0.0.1:4318/v1/traces"
    grpc_exporter.shutdown()
    http_exporter.shutdown()

"""OpenTelemetry tracing of one request across the router, the prefill and decode workers and the KV transfer.

Lifecycle: each process calls `setup_tracing(config.tracing, role, instance_id)` once at start and the
function it returns at exit (flush, shut down). With `tracing.enabled` false nothing is installed: the
OpenTelemetry API's tracer stays the no-op one, every span below is a non-recording span and no trace
context travels. Enabled, a `TracerProvider` is installed whose resource names the process
(`service.name` = `<service_name>-<role>`, `service.instance.id`), whose sampler is parent-based over
`sample_ratio` (the router decides; the workers follow the decision that arrives with the call, so a
request is traced in every process or in none) and whose batch processor feeds the configured exporter.

Spans are opened with `span(name, parent)` / `server_span(name, grpc_context)` and never made current:
a child names its parent explicitly (`context_of(span)`), which holds across the yields of async
generators and needs nothing from the KV transfer's own threads. Across processes the W3C trace
context travels in gRPC metadata: `outgoing_metadata(ctx)` on the router's calls, the servicer's
`server_span` reads it back. Only the request's own calls carry it (no span for Stats, heartbeats,
registration). Span names and attributes: docs/observability.md.
"""

from __future__ import annotations

import asyncio
import os
import sys
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from importlib import import_module
from pathlib import Path
from typing import Any

import grpc
from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import SERVICE_INSTANCE_ID, SERVICE_NAME, Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SpanExporter, SpanExportResult
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
from opentelemetry.trace import Span, SpanKind, Status, StatusCode

from common.config import OTLP_MODULES, TracingConfig

TRACER_NAME = "pdserve"
_tracer = trace.get_tracer(TRACER_NAME)
"""A proxy: it becomes the installed provider's tracer once `setup_tracing` ran, a no-op tracer until then."""


def setup_tracing(config: TracingConfig, role: str, instance_id: str = "") -> Callable[[], None]:
    """Install this process's tracer provider from `config`; returns what flushes and shuts it down."""
    if not config.enabled:
        return lambda: None
    provider = build_provider(config, role, instance_id)
    trace.set_tracer_provider(provider)
    return provider.shutdown


def build_provider(config: TracingConfig, role: str, instance_id: str = "", exporter: SpanExporter | None = None) -> TracerProvider:
    """The provider `setup_tracing` installs; `exporter` replaces the configured one (tests)."""
    attributes = {SERVICE_NAME: f"{config.service_name}-{role}"}
    if instance_id:
        attributes[SERVICE_INSTANCE_ID] = instance_id
    provider = TracerProvider(resource=Resource.create(attributes), sampler=ParentBased(TraceIdRatioBased(config.sample_ratio)))
    provider.add_span_processor(BatchSpanProcessor(exporter or make_exporter(config, role)))
    return provider


def make_exporter(config: TracingConfig, role: str) -> SpanExporter:
    if config.exporter == "console":
        return ConsoleSpanExporter(out=sys.stderr)  # stdout carries the process's ready line
    if config.exporter == "file":
        return JsonLinesSpanExporter(Path(config.directory) / f"{config.service_name}-{role}-{os.getpid()}.jsonl")
    otlp = import_module(OTLP_MODULES[config.protocol])  # the optional pdserve[otlp]; config validation checked it
    return otlp.OTLPSpanExporter(endpoint=config.endpoint or None)


class JsonLinesSpanExporter(SpanExporter):
    """The `file` exporter: each span as one line of the SDK's own JSON form (`ReadableSpan.to_json`),
    appended to a file of this process (for debugging, and for tests that read every process's spans)."""

    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file = path.open("a", encoding="utf-8")
        self._lock = threading.Lock()

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        with self._lock:
            try:
                self._file.writelines(s.to_json(indent=None) + "\n" for s in spans)
                self._file.flush()
            except (OSError, ValueError):  # disk full, or closed by shutdown
                return SpanExportResult.FAILURE
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        with self._lock:
            self._file.close()


# ---- spans ----------------------------------------------------------------------------------------

@contextmanager
def span(name: str, parent: Context, kind: SpanKind = SpanKind.INTERNAL, grpc_context: Any = None, **attributes: Any) -> Iterator[Span]:
    """A span under `parent` (an empty Context: a new trace), ended on leaving the block. An exception
    sets status ERROR with its message (a gRPC abort: the status code and details it sent, given the
    servicer's `grpc_context`); a cancellation is an event, not an error. Attributes that are None are left out."""
    current = start_span(name, parent, kind, **attributes)
    try:
        yield current
    except asyncio.CancelledError:
        current.add_event("cancelled")
        raise
    except Exception as exc:
        code = grpc_context.code() if grpc_context is not None else None
        fail(current, f"{code.name}: {grpc_context.details()}" if code is not None else exc)
        raise
    finally:
        current.end()


def start_span(name: str, parent: Context, kind: SpanKind = SpanKind.INTERNAL, **attributes: Any) -> Span:
    """A span under `parent` that the caller ends (`span.end()`): for one that outlives a block."""
    return _tracer.start_span(name, context=parent, kind=kind, attributes=_present(attributes))


@contextmanager
def server_span(name: str, grpc_context: Any, **attributes: Any) -> Iterator[Span]:
    """A servicer's span for one call, a child of the span whose context came in the call's metadata."""
    with span(name, incoming_context(grpc_context), SpanKind.SERVER, grpc_context, **attributes) as current:
        yield current


def fail(current: Span, error: BaseException | str) -> None:
    """Status ERROR with the error's message (an exception is recorded as an event too)."""
    if isinstance(error, grpc.aio.AioRpcError):
        current.record_exception(error)
        error = f"{error.code().name}: {error.details()}"
    elif isinstance(error, BaseException):
        current.record_exception(error)
        error = str(error) or type(error).__name__
    current.set_status(Status(StatusCode.ERROR, error))


def annotate(current: Span, **attributes: Any) -> None:
    """Attributes learned after the span began (None values left out)."""
    current.set_attributes(_present(attributes))


def context_of(current: Span) -> Context:
    """The context whose parent is `current`: what its children and outgoing calls are given."""
    return trace.set_span_in_context(current, Context())


# ---- propagation ----------------------------------------------------------------------------------

def outgoing_metadata(parent: Context) -> tuple[tuple[str, str], ...]:
    """gRPC metadata carrying `parent`'s trace context (W3C `traceparent`, `tracestate`); empty when
    tracing is off or the request is not sampled-in anywhere."""
    carrier: dict[str, str] = {}
    propagate.inject(carrier, context=parent)
    return tuple(carrier.items())


def incoming_context(grpc_context: Any) -> Context:
    """The trace context a gRPC call's metadata carries (an empty Context when none)."""
    metadata = grpc_context.invocation_metadata() or ()
    return context_from({key: value for key, value in metadata if isinstance(value, str)})


def http_context(headers: Mapping[str, str]) -> Context:
    """The parent of an HTTP request's spans: the web framework's request span when it made one
    current (FastAPI's own telemetry, which continued the client's trace), else the headers' context."""
    current = otel_context.get_current()
    return current if trace.get_current_span(current).get_span_context().is_valid else context_from(headers)


def context_from(carrier: Mapping[str, str]) -> Context:
    """The trace context in string headers (HTTP request headers, gRPC metadata); empty when none."""
    return propagate.extract(carrier, context=Context())


def _present(attributes: dict[str, Any]) -> dict[str, Any]:
    return {f"pdserve.{key}": value for key, value in attributes.items() if value is not None}

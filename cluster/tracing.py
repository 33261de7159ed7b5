"""OpenTelemetry tracing: one TracerProvider per ingress and engine replica, exported over OTLP.

Off unless `otlp_endpoint` is set (`--otlp-endpoint URL`). Off costs nothing: `setup_tracing`
returns None, the code that would trace holds that None and tests it once per request, and
nothing here imports opentelemetry at module level (the SDK and the OTLP exporter are imported
by `setup_tracing`, only when tracing is on). The exporter is the optional extra
`pip install 'kvray[otel]'`; an endpoint without it fails the replica's start with a message
naming the extra.

Each process exports its own spans (a BatchSpanProcessor: spans leave in the background,
batched, every few seconds; OpenTelemetry's OTEL_BSP_* variables tune it), under the resource
`service.name = kvray` with the deployment's name (`kvray.deployment`). The trace context
crosses processes as a W3C `traceparent` / `tracestate` carrier: from HTTP headers and gRPC
metadata into the ingress's server span, and from the ingress to the engine replica inside
the request message (`GenerateRequest.trace_context`). Sampling is parent-based: an incoming
`traceparent` decides; a new trace is sampled with probability `otlp_sample_ratio`.

Who makes which span: cluster/http/tracing.py and cluster/grpc_api/tracing.py (the server
spans), cluster/ingress/route_spans.py (one span per attempt to reach a replica),
cluster/replica/engine_spans.py (the replica's span and the engine's phases), and
`migration_event` below (cluster/ingress/migration.py). docs/serving.md#tracing lists them.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
import socket
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

if TYPE_CHECKING:
    from opentelemetry.sdk.trace.export import SpanExporter
    from opentelemetry.trace import Span

    from cluster.config import ServeConfig
    from cluster.errors import EngineDeadError
    from cluster.messages import GenerateRequest

SERVICE_NAME = "kvray"
TRACER_NAME = "kvray"
OTEL_EXTRA = "pip install 'kvray[otel]'"
# OTLP/HTTP's path for traces: appended to an endpoint given without a path, as
# OTEL_EXPORTER_OTLP_ENDPOINT is (a collector's base URL, e.g. http://collector:4318).
TRACES_PATH = "/v1/traces"
OTLP_EXPORTER_MODULE = "opentelemetry.exporter.otlp.proto.http.trace_exporter"


class TracingUnavailableError(RuntimeError):
    """`otlp_endpoint` is set but the OTLP exporter package is not installed."""


def setup_tracing(config: ServeConfig, deployment: str) -> Tracing | None:
    """This process's Tracing when `config.tracing.otlp_endpoint` is set, else None (tracing off).

    Called once by each ingress and engine replica as it starts; raises
    TracingUnavailableError (naming the extra to install) when the exporter is missing."""
    if not config.tracing.otlp_endpoint:
        return None
    return Tracing.with_exporter(
        otlp_exporter(config.tracing.otlp_endpoint), deployment, config.tracing.otlp_sample_ratio
    )


def exporter_missing(config: ServeConfig) -> str | None:
    """Why `config`'s tracing cannot start in this Python, or None: checked by `kvray serve`
    before it starts a local Ray, whose replicas run this Python."""
    if not config.tracing.otlp_endpoint:
        return None
    try:
        found = importlib.util.find_spec(OTLP_EXPORTER_MODULE) is not None
    except ModuleNotFoundError:  # a parent package is missing
        found = False
    if found:
        return None
    return (
        f"--otlp-endpoint needs the OTLP exporter, which is not installed: {OTEL_EXTRA} "
        "(opentelemetry-exporter-otlp-proto-http)"
    )


def otlp_exporter(endpoint: str) -> SpanExporter:
    """The OTLP/HTTP (protobuf) span exporter for `endpoint` (see `traces_url`)."""
    try:
        exporter = importlib.import_module(OTLP_EXPORTER_MODULE)
    except ImportError as err:
        raise TracingUnavailableError(
            f"otlp_endpoint ({endpoint}) needs the OTLP exporter, which is not installed "
            f"here: {OTEL_EXTRA} (opentelemetry-exporter-otlp-proto-http); {err}"
        ) from None
    return exporter.OTLPSpanExporter(endpoint=traces_url(endpoint))


def traces_url(endpoint: str) -> str:
    """The URL spans are POSTed to: `endpoint` as given when it has a path, else the
    collector's base URL + /v1/traces."""
    parts = urlsplit(endpoint)
    if parts.path in ("", "/"):
        return endpoint.rstrip("/") + TRACES_PATH
    return endpoint


class Tracing:
    """One process's tracer and the W3C propagator (made only when tracing is on)."""

    def __init__(self, provider: Any) -> None:
        from opentelemetry import context, trace
        from opentelemetry.trace import SpanKind, Status, StatusCode
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self.provider = provider  # opentelemetry.sdk.trace.TracerProvider
        self.tracer = provider.get_tracer(TRACER_NAME)
        self._propagator = TraceContextTextMapPropagator()
        self._trace = trace
        self._context = context
        self._kinds = {k.name.lower(): k for k in SpanKind}
        self._status, self._error_code = Status, StatusCode.ERROR

    @staticmethod
    def with_exporter(
        exporter: SpanExporter, deployment: str, sample_ratio: float = 1.0, batch: bool = True
    ) -> Tracing:
        """A provider exporting to `exporter`: batched in the background, or (`batch=False`,
        for tests) synchronously as each span ends."""
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
        from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

        resource = Resource.create(
            {
                "service.name": SERVICE_NAME,
                "kvray.deployment": deployment,
                "host.name": socket.gethostname(),
                "process.pid": os.getpid(),
            }
        )
        provider = TracerProvider(
            resource=resource, sampler=ParentBased(root=TraceIdRatioBased(sample_ratio))
        )
        processor = BatchSpanProcessor(exporter) if batch else SimpleSpanProcessor(exporter)
        provider.add_span_processor(processor)
        return Tracing(provider)

    def start_span(
        self,
        name: str,
        parent: Mapping[str, str] | None,
        *,
        kind: str = "internal",
        attributes: Mapping[str, Any] | None = None,
        start_ns: int | None = None,
    ) -> Span:
        """A span whose parent is the W3C carrier `parent` (None or empty: a new trace).
        Never the ambient context: a span's parent is always the one it is given."""
        return self.tracer.start_span(
            name,
            context=self._propagator.extract(parent or {}),
            kind=self._kinds[kind],
            attributes=attributes,
            start_time=start_ns,
        )

    def start_child(
        self,
        name: str,
        parent: Span,
        *,
        attributes: Mapping[str, Any] | None = None,
        start_ns: int | None = None,
    ) -> Span:
        """An internal span under `parent` (a span of this process)."""
        return self.tracer.start_span(
            name,
            context=self._trace.set_span_in_context(parent),
            attributes=attributes,
            start_time=start_ns,
        )

    def carrier(self, span: Span) -> dict[str, str]:
        """`span`'s context as a W3C carrier ({"traceparent": ..., "tracestate": ...})."""
        out: dict[str, str] = {}
        self._propagator.inject(out, context=self._trace.set_span_in_context(span))
        return out

    def current_carrier(self) -> dict[str, str]:
        """The ambient span's context (the server span the ingress made current) as a
        carrier; empty when there is none."""
        out: dict[str, str] = {}
        self._propagator.inject(out)
        return out

    @contextlib.contextmanager
    def current(self, span: Span) -> Iterator[None]:
        """Makes `span` the ambient span of this task while the block runs: what the
        request's handling reads (`current_carrier`, `migration_event`)."""
        token = self._context.attach(self._trace.set_span_in_context(span))
        try:
            yield
        finally:
            self._context.detach(token)

    def set_error(self, span: Span, err: BaseException) -> None:
        """Marks `span` failed by `err` (an exception event, status ERROR, error.type)."""
        span.record_exception(err)
        self.set_failed(span, type(err).__name__, str(err))

    def set_failed(self, span: Span, error_type: str, description: str = "") -> None:
        """Status ERROR with OpenTelemetry's `error.type` (a class name, a status code)."""
        span.set_attribute("error.type", error_type)
        span.set_status(self._status(self._error_code, description[:200]))

    def force_flush(self) -> bool:
        return bool(self.provider.force_flush())

    def shutdown(self) -> None:
        """Exports what is pending, then stops (also done at the process's exit)."""
        self.provider.shutdown()


def migration_event(
    request: GenerateRequest, error: EngineDeadError, attempt: int, tokens: int
) -> None:
    """A `kvray.migration` event on the ambient span (the ingress's server span) when the
    request is traced: why it moved, the replica it left, the attempt it starts, the tokens
    the client already had. Nothing (no import) when it is not."""
    if request.trace_context is None:
        return
    from opentelemetry import trace

    trace.get_current_span().add_event(
        "kvray.migration",
        {
            "kvray.migration.cause": error.cause,
            "kvray.migration.replica_left": error.replica or "",
            "kvray.migration.attempt": attempt,
            "kvray.migration.tokens": tokens,
        },
    )

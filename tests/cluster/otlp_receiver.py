"""A tiny OTLP/HTTP trace receiver for tests: what an OpenTelemetry collector does with
`POST /v1/traces` (protobuf `ExportTraceServiceRequest`, possibly gzipped), minus the rest.

    with OtlpReceiver() as rx:        # listens on 127.0.0.1:<free port>
        ... rx.endpoint ...           # http://127.0.0.1:PORT, for --otlp-endpoint
        rx.spans()                    # every span received so far, decoded
"""

from __future__ import annotations

import gzip
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


@dataclass(frozen=True)
class ReceivedSpan:
    name: str
    trace_id: str  # 32 hex digits
    span_id: str  # 16 hex digits
    parent_span_id: str  # "" for a root span
    kind: str  # SPAN_KIND_SERVER, ...
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]
    resource: dict[str, Any]
    status: str  # STATUS_CODE_UNSET | STATUS_CODE_OK | STATUS_CODE_ERROR
    events: list[tuple[str, dict[str, Any]]] = field(default_factory=list)


def _value(v: Any) -> Any:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return tuple(_value(x) for x in v.array_value.values)
    return getattr(v, kind) if kind else None


def _attrs(kvs: Any) -> dict[str, Any]:
    return {kv.key: _value(kv.value) for kv in kvs}


def decode(body: bytes) -> list[ReceivedSpan]:
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
        ExportTraceServiceRequest,
    )
    from opentelemetry.proto.trace.v1.trace_pb2 import Span, Status

    req = ExportTraceServiceRequest.FromString(body)
    out = []
    for rs in req.resource_spans:
        resource = _attrs(rs.resource.attributes)
        for ss in rs.scope_spans:
            for s in ss.spans:
                out.append(
                    ReceivedSpan(
                        name=s.name,
                        trace_id=s.trace_id.hex(),
                        span_id=s.span_id.hex(),
                        parent_span_id=s.parent_span_id.hex(),
                        kind=Span.SpanKind.Name(s.kind),
                        start_ns=s.start_time_unix_nano,
                        end_ns=s.end_time_unix_nano,
                        attributes=_attrs(s.attributes),
                        resource=resource,
                        status=Status.StatusCode.Name(s.status.code),
                        events=[(e.name, _attrs(e.attributes)) for e in s.events],
                    )
                )
    return out


class OtlpReceiver:
    def __init__(self) -> None:
        self._spans: list[ReceivedSpan] = []
        self._lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                if self.path != "/v1/traces":
                    self.send_response(404)
                    self.end_headers()
                    return
                spans = decode(body)
                with receiver._lock:
                    receiver._spans.extend(spans)
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *_: Any) -> None:  # quiet
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def __enter__(self) -> OtlpReceiver:
        self._thread.start()
        return self

    def __exit__(self, *_: Any) -> None:
        self._server.shutdown()
        self._server.server_close()

    def spans(self) -> list[ReceivedSpan]:
        with self._lock:
            return list(self._spans)

"""cluster/http/tracing.py: the HTTP server span, through httpx against a small FastAPI app
behind the middleware (the live test, tests/cluster/test_tracing_live.py, runs kvray's)."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
from fastapi import FastAPI
from fastapi.responses import JSONResponse, StreamingResponse
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from cluster.http.tracing import TraceMiddleware, traced_app
from cluster.ingress.route_spans import RouteSpans
from cluster.tracing import Tracing

TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
TRACEPARENT = f"00-{TRACE_ID}-b7ad6b7169203331-01"


def app_and_spans() -> tuple[Any, Tracing, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    tracing = Tracing.with_exporter(exporter, "OpenAIIngress", batch=False)
    api = FastAPI()

    @api.post("/v1/completions")
    async def completions() -> dict[str, str]:
        # What LLMClient reads to tie a request to this span.
        return tracing.current_carrier()

    @api.post("/v1/chat/completions")
    async def chat() -> StreamingResponse:
        async def events() -> Any:
            for i in range(3):
                yield f"data: {i}\n\n"
                await asyncio.sleep(0)

        return StreamingResponse(events(), media_type="text/event-stream")

    @api.get("/v1/models")
    async def models() -> JSONResponse:
        return JSONResponse({"error": "down"}, status_code=503)

    @api.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    return traced_app(api, RouteSpans(tracing, "prefix_affinity")), tracing, exporter


async def call(app: Any, method: str, path: str, **kw: Any) -> httpx.Response:
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://kvray") as client:
        return await client.request(method, path, **kw)


def test_off_the_app_is_served_as_is() -> None:
    app = FastAPI()
    assert traced_app(app, None) is app


def test_a_request_is_a_server_span_under_its_traceparent() -> None:
    app, _, exporter = app_and_spans()
    assert isinstance(app, TraceMiddleware)
    resp = asyncio.run(call(app, "POST", "/v1/completions", headers={"traceparent": TRACEPARENT}))
    (span,) = exporter.get_finished_spans()
    assert span.name == "POST /v1/completions"
    assert span.kind.name == "SERVER"
    assert f"{span.context.trace_id:032x}" == TRACE_ID
    assert f"{span.parent.span_id:016x}" == "b7ad6b7169203331"
    assert dict(span.attributes) == {
        "http.request.method": "POST",
        "url.path": "/v1/completions",
        "url.scheme": "http",
        "http.route": "/v1/completions",
        "http.response.status_code": 200,
    }
    # The handler ran with the span as its ambient span.
    assert resp.json() == {"traceparent": f"00-{TRACE_ID}-{span.context.span_id:016x}-01"}


def test_a_stream_is_one_span_ending_after_its_last_event() -> None:
    app, _, exporter = app_and_spans()
    resp = asyncio.run(call(app, "POST", "/v1/chat/completions"))
    assert resp.text == "data: 0\n\ndata: 1\n\ndata: 2\n\n"
    (span,) = exporter.get_finished_spans()
    assert span.name == "POST /v1/chat/completions" and span.parent is None


def test_a_5xx_sets_the_error_status_and_probes_are_not_traced() -> None:
    app, _, exporter = app_and_spans()
    asyncio.run(call(app, "GET", "/health"))
    asyncio.run(call(app, "GET", "/v1/models"))
    (span,) = exporter.get_finished_spans()
    assert span.attributes["http.response.status_code"] == 503
    assert span.attributes["error.type"] == "503" and not span.status.is_ok


def test_an_unknown_path_is_named_by_its_method_alone() -> None:
    app, _, exporter = app_and_spans()
    assert asyncio.run(call(app, "GET", "/wp-admin/x.php")).status_code == 404
    (span,) = exporter.get_finished_spans()
    assert span.name == "GET" and "http.route" not in span.attributes
    assert span.status.is_unset  # a client's 4xx is not the server's failure

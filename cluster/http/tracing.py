"""The HTTP ingress's server span: one per request, under the client's W3C `traceparent`.

An ASGI middleware, outermost (before the API key and body checks, so a refused request is
traced too), installed only when tracing is on (`traced_app` returns the app unchanged
otherwise). It reads `traceparent` / `tracestate` from the headers (none, or a malformed one:
a new trace), opens a server span named after the method and route (`POST
/v1/chat/completions`; the method alone for an unknown path, so scanners do not mint span
names), makes it the ambient span while the app handles the request (the routing spans and
the migration events hang under it) and closes it when the response is sent, a stream's last
event included. Attributes follow OpenTelemetry's HTTP conventions; a 5xx sets the status to
error. The probes (/health, /ready) are not traced: they would bury the requests.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from cluster.http.guard import UNPACED_PATHS, api_path

if TYPE_CHECKING:
    from cluster.ingress.route_spans import RouteSpans
    from cluster.tracing import Tracing

Scope = dict[str, Any]
# The routes a span is named after (docs/contracts.md's HTTP routes).
ROUTES = frozenset(
    {
        "/v1/completions",
        "/v1/chat/completions",
        "/v1/responses",
        "/v1/embeddings",
        "/v1/models",
        "/tokenize",
        "/detokenize",
        "/docs",
        "/redoc",
        "/openapi.json",
    }
)
TRACE_HEADERS = (b"traceparent", b"tracestate")


def traced_app(app: Any, spans: RouteSpans | None) -> Any:
    """`app` behind the tracing middleware when tracing is on; `app` itself when it is off."""
    return app if spans is None else TraceMiddleware(app, spans.tracing)


class TraceMiddleware:
    def __init__(self, app: Any, tracing: Tracing) -> None:
        self.app = app
        self.tracing = tracing

    def __getattr__(self, name: str) -> Any:  # Ray Serve adds exception handlers to the app
        return getattr(self.app, name)

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        path = api_path(scope) if scope.get("type") == "http" else ""
        if not path or path in UNPACED_PATHS:
            await self.app(scope, receive, send)
            return
        method = scope.get("method", "GET")
        route = path if path in ROUTES else None
        attributes: dict[str, Any] = {
            "http.request.method": method,
            "url.path": path,
            "url.scheme": scope.get("scheme", "http"),
        }
        if route is not None:
            attributes["http.route"] = route
        carrier = {
            k.decode("latin-1"): v.decode("latin-1")
            for k, v in scope.get("headers", ())
            if k in TRACE_HEADERS
        }
        span = self.tracing.start_span(
            f"{method} {route}" if route else method, carrier, kind="server", attributes=attributes
        )
        status = 0

        async def send_traced(message: dict[str, Any]) -> None:
            nonlocal status
            if message.get("type") == "http.response.start":
                status = int(message.get("status", 0))
                span.set_attribute("http.response.status_code", status)
            await send(message)

        try:
            with self.tracing.current(span):
                await self.app(scope, receive, send_traced)
        except Exception as err:
            self.tracing.set_error(span, err)
            raise
        else:
            if status >= 500:
                self.tracing.set_failed(span, str(status))
        finally:
            span.end()

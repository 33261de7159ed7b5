"""The ingress's routing spans: one `kvray.route` span per attempt to reach an engine replica.

`LLMClient` (cluster/ingress/llm_client.py) holds a RouteSpans when tracing is on, None
otherwise. A request is tied to the ingress's server span when `generate` is called (its
`trace_context` is that span's, taken from the ambient context the HTTP middleware or the gRPC
interceptor set); each attempt (the first, then one per migration) opens a `kvray.route`
span under it and sends the replica that span's context, so the replica's span hangs under
the attempt that reached it. The span covers the handle call: Serve's routing and the replica's
whole answer (a stream's last chunk included). Its attributes: the router, the migration
attempt and the replicas it avoids; a failure records the error, and an EngineDeadError the
replica it failed on.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from cluster.tracing import setup_tracing

if TYPE_CHECKING:
    from opentelemetry.trace import Span

    from cluster.config import ServeConfig
    from cluster.messages import GenerateRequest
    from cluster.tracing import Tracing

ROUTE_SPAN = "kvray.route"


@dataclass(frozen=True)
class RouteSpans:
    tracing: Tracing
    router: str  # ServeConfig.replicas.request_router: prefix_affinity, kv_events, power_of_two

    def traced(self, request: GenerateRequest) -> GenerateRequest:
        """`request` tied to the ambient (server) span, unless it carries a context already."""
        if request.trace_context is not None:
            return request
        return dataclasses.replace(request, trace_context=self.tracing.current_carrier())

    def start(self, request: GenerateRequest) -> tuple[Span, GenerateRequest]:
        """The attempt's span, and the request to send: carrying that span's context."""
        attributes: dict[str, Any] = {
            "kvray.request_id": request.request_id,
            "kvray.router": self.router,
            "kvray.migration.attempt": request.migration,
        }
        if request.exclude_replicas:
            attributes["kvray.migration.excluded_replicas"] = sorted(request.exclude_replicas)
        if request.routing_key:
            attributes["kvray.routing_key"] = request.routing_key
        span = self.tracing.start_span(
            ROUTE_SPAN, request.trace_context, kind="client", attributes=attributes
        )
        sent = dataclasses.replace(request, trace_context=self.tracing.carrier(span))
        return span, sent

    def failed(self, span: Span, err: BaseException) -> None:
        self.tracing.set_error(span, err)
        replica = getattr(err, "replica", None)
        if replica:  # EngineDeadError: the replica the attempt died on
            span.set_attribute("kvray.replica", replica)
            span.set_attribute("kvray.error.cause", str(getattr(err, "cause", "")))

    @staticmethod
    def end(span: Span, finished: bool) -> None:
        if not finished:  # the consumer left early, or the attempt failed
            span.set_attribute("kvray.finished", False)
        span.end()


def route_spans(config: ServeConfig, deployment: str) -> RouteSpans | None:
    """An ingress's RouteSpans when tracing is on (its own TracerProvider), else None."""
    tracing = setup_tracing(config, deployment)
    return None if tracing is None else RouteSpans(tracing, config.replicas.request_router)

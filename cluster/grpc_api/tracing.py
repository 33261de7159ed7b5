"""The gRPC ingress's server span: one per kvray.v1.LLMService call, under the client's
`traceparent` metadata.

A grpc.aio server interceptor, installed only when tracing is on (`trace_interceptors` gives
none otherwise). It wraps each LLMService method's handler (health checks and reflection are
left alone: probes would bury the requests): reads `traceparent` / `tracestate` from the
call's metadata (none, or a malformed one: a new trace), opens a server span named
`kvray.v1.LLMService/Generate` (OpenTelemetry's RPC conventions: rpc.system, rpc.service,
rpc.method, rpc.grpc.status_code), makes it the ambient span while the servicer runs (the
routing spans and migration events hang under it) and closes it with the call's status. The
status codes OpenTelemetry counts as server errors set the span's status to error.
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import grpc
import grpc.aio

if TYPE_CHECKING:
    from cluster.ingress.route_spans import RouteSpans
    from cluster.tracing import Tracing

SERVICE = "kvray.v1.LLMService"
TRACE_METADATA = ("traceparent", "tracestate")
# A server span's error codes (OpenTelemetry's gRPC conventions); the others are the client's.
SERVER_ERRORS = frozenset(
    {
        grpc.StatusCode.UNKNOWN,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.UNIMPLEMENTED,
        grpc.StatusCode.INTERNAL,
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.DATA_LOSS,
    }
)


def trace_interceptors(spans: RouteSpans | None) -> list[grpc.aio.ServerInterceptor]:
    """The server's interceptors: the tracing one when tracing is on, none when it is off."""
    return [] if spans is None else [TraceInterceptor(spans.tracing)]


class TraceInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, tracing: Tracing) -> None:
        self.tracing = tracing

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        service, _, method = details.method.lstrip("/").partition("/")  # type: ignore[attr-defined]
        if handler is None or service != SERVICE:
            return handler
        metadata = details.invocation_metadata or ()  # type: ignore[attr-defined]
        carrier = {k: v for k, v in metadata if k in TRACE_METADATA and isinstance(v, str)}
        wrap = self._wrap(service, method, carrier)
        if handler.unary_unary is not None and inspect.iscoroutinefunction(handler.unary_unary):
            return grpc.unary_unary_rpc_method_handler(
                wrap(handler.unary_unary),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        if handler.unary_stream is not None and inspect.iscoroutinefunction(handler.unary_stream):
            # kvray's streaming methods write with context.write: a coroutine, like unary ones.
            return grpc.unary_stream_rpc_method_handler(
                wrap(handler.unary_stream),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        return handler

    def _wrap(
        self, service: str, method: str, carrier: dict[str, str]
    ) -> Callable[[Callable[..., Awaitable[Any]]], Callable[..., Awaitable[Any]]]:
        tracing = self.tracing
        attributes = {"rpc.system": "grpc", "rpc.service": service, "rpc.method": method}

        def wrap(behavior: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
            async def traced(request: Any, context: grpc.aio.ServicerContext) -> Any:
                span = tracing.start_span(
                    f"{service}/{method}", carrier, kind="server", attributes=attributes
                )
                try:
                    with tracing.current(span):
                        return await behavior(request, context)
                except grpc.aio.AbortError:
                    raise  # the status was set: read below
                except Exception as err:
                    tracing.set_error(span, err)
                    raise
                finally:
                    code = context.code() or grpc.StatusCode.OK  # None until one is set
                    if isinstance(code, int):  # grpc.aio keeps the number once aborted
                        code = _BY_NUMBER.get(code, grpc.StatusCode.UNKNOWN)
                    span.set_attribute("rpc.grpc.status_code", code.value[0])
                    if code in SERVER_ERRORS:
                        tracing.set_failed(span, code.name, context.details() or "")
                    span.end()

            return traced

        return wrap


_BY_NUMBER = {c.value[0]: c for c in grpc.StatusCode}

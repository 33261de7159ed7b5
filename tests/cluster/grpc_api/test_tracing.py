"""cluster/grpc_api/tracing.py: the gRPC server span, on a real grpc.aio server and client
with a small LLMService (the live test, tests/cluster/test_tracing_live.py, runs kvray's)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
import grpc.aio
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from cluster.grpc_api.tracing import trace_interceptors
from cluster.ingress.route_spans import RouteSpans
from cluster.tracing import Tracing
from kvray.v1 import llm_pb2, llm_pb2_grpc

TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
TRACEPARENT = f"00-{TRACE_ID}-b7ad6b7169203331-01"


class Service(llm_pb2_grpc.LLMServiceServicer):
    def __init__(self, tracing: Tracing) -> None:
        self.tracing = tracing

    async def ListModels(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        # The ambient span's traceparent, as LLMClient would read it.
        carrier = self.tracing.current_carrier()
        return llm_pb2.ListModelsResponse(models=[llm_pb2.Model(id=carrier["traceparent"])])

    async def GenerateStream(self, request: Any, context: grpc.aio.ServicerContext) -> None:
        for _ in range(2):
            await context.write(llm_pb2.GenerateResponse())

    async def Generate(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "prompt: bad")

    async def Tokenize(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(grpc.StatusCode.UNAVAILABLE, "no replica")


Body = Callable[[llm_pb2_grpc.LLMServiceStub, grpc.aio.Channel], Awaitable[None]]


def serve(body: Body) -> tuple[InMemorySpanExporter, Tracing]:
    exporter = InMemorySpanExporter()
    tracing = Tracing.with_exporter(exporter, "GrpcIngress", batch=False)

    async def run() -> None:
        server = grpc.aio.server(interceptors=trace_interceptors(RouteSpans(tracing, "x")))
        llm_pb2_grpc.add_LLMServiceServicer_to_server(Service(tracing), server)
        health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                await body(llm_pb2_grpc.LLMServiceStub(channel), channel)
        finally:
            await server.stop(None)

    asyncio.run(run())
    return exporter, tracing


def test_off_no_interceptor() -> None:
    assert trace_interceptors(None) == []


def test_a_call_is_a_server_span_under_its_traceparent_metadata() -> None:
    got: list[str] = []

    async def body(stub: llm_pb2_grpc.LLMServiceStub, _: grpc.aio.Channel) -> None:
        resp = await stub.ListModels(
            llm_pb2.ListModelsRequest(), metadata=(("traceparent", TRACEPARENT),)
        )
        got.append(resp.models[0].id)

    exporter, _ = serve(body)
    (span,) = exporter.get_finished_spans()
    assert span.name == "kvray.v1.LLMService/ListModels"
    assert span.kind.name == "SERVER"
    assert f"{span.context.trace_id:032x}" == TRACE_ID
    assert f"{span.parent.span_id:016x}" == "b7ad6b7169203331"
    assert dict(span.attributes) == {
        "rpc.system": "grpc",
        "rpc.service": "kvray.v1.LLMService",
        "rpc.method": "ListModels",
        "rpc.grpc.status_code": 0,
    }
    assert got == [f"00-{TRACE_ID}-{span.context.span_id:016x}-01"]  # the ambient span


def test_streams_statuses_and_untraced_services() -> None:
    async def body(stub: llm_pb2_grpc.LLMServiceStub, channel: grpc.aio.Channel) -> None:
        assert len([m async for m in stub.GenerateStream(llm_pb2.GenerateRequest())]) == 2
        for call in (
            stub.Generate(llm_pb2.GenerateRequest()),
            stub.Tokenize(llm_pb2.TokenizeRequest()),
        ):
            try:
                await call
            except grpc.aio.AioRpcError:
                pass
        await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())

    exporter, _ = serve(body)
    by_method = {s.attributes["rpc.method"]: s for s in exporter.get_finished_spans()}
    assert set(by_method) == {"GenerateStream", "Generate", "Tokenize"}  # no health span
    assert by_method["GenerateStream"].attributes["rpc.grpc.status_code"] == 0
    bad = by_method["Generate"]  # the client's error: not the server's failure
    assert bad.attributes["rpc.grpc.status_code"] == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert bad.status.is_unset and bad.parent is None
    down = by_method["Tokenize"]
    assert down.attributes["rpc.grpc.status_code"] == grpc.StatusCode.UNAVAILABLE.value[0]
    assert down.attributes["error.type"] == "UNAVAILABLE" and not down.status.is_ok
    assert down.status.description == "no replica"

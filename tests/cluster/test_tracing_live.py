"""Tracing end to end: a kvray app with `otlp_endpoint` set exports, from its ingress and
engine replica processes over real OTLP/HTTP, to a receiver in this test; one HTTP request
(official `openai` client, a `traceparent` header) and one gRPC call (`traceparent`
metadata) each come back as one trace under the caller's span:

    POST /v1/chat/completions | kvray.v1.LLMService/Generate     (ingress, server)
      kvray.route                                                (ingress, per attempt)
        kvray.replica.generate                                   (engine replica)
          kvray.engine.queue, kvray.engine.prefill, kvray.engine.decode

Its own application (one replica) with its own gRPC port, so no other app's ingress
answers these calls. Migration's event is covered without killing engines
(tests/cluster/test_tracing.py, tests/cluster/ingress/test_route_spans.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import grpc
import pytest

from cluster.grpc_api.client import build_generate_request
from kvray.v1 import llm_pb2_grpc
from tests.cluster.grpc_api.grpc_helpers import wait_serving
from tests.cluster.otlp_receiver import OtlpReceiver, ReceivedSpan
from tests.cluster.serve_helpers import (
    KV_CACHE_BYTES,
    TEST_GRPC_DRAIN_S,
    App,
    ServePorts,
    free_port,
    openai_client,
    wait_for,
)

PARENT_SPAN = "b7ad6b7169203331"
HTTP_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
GRPC_TRACE = "5ce0e9a56015fec5aadfa328ae398115"
ENGINE_PHASES = ("kvray.engine.queue", "kvray.engine.prefill", "kvray.engine.decode")
MAX_TOKENS = 8


def traceparent(trace_id: str) -> str:
    return f"00-{trace_id}-{PARENT_SPAN}-01"


@dataclass(frozen=True)
class Traced:
    app: App
    receiver: OtlpReceiver
    http_chunks: int  # the streamed chat's chunks
    grpc_completions: int  # the gRPC answer's completions


def send_both(app: App, grpc_port: int) -> tuple[int, int]:
    """One streamed chat over HTTP and one Generate over gRPC, each with its traceparent, both
    sent before any test waits: their spans then leave in the same export rounds."""
    stream = openai_client(app).chat.completions.create(
        model=app.model,
        messages=[{"role": "user", "content": "Tell me about the sea."}],
        max_tokens=MAX_TOKENS,
        temperature=0.0,
        stream=True,
        extra_headers={"traceparent": traceparent(HTTP_TRACE)},
    )
    chunks = len(list(stream))
    with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
        stub = llm_pb2_grpc.LLMServiceStub(channel)
        req = build_generate_request("Once upon a time", max_tokens=MAX_TOKENS, temperature=0.0)
        resp = stub.Generate(req, metadata=(("traceparent", traceparent(GRPC_TRACE)),))
    return chunks, len(resp.completions)


@pytest.fixture(scope="module")
def traced(serve_ports: ServePorts) -> Iterator[Traced]:
    from ray import serve

    from cluster.config import ServeConfig
    from cluster.deploy.app import ingress_options, llm_server_options
    from cluster.grpc_api.ingress import GrpcSettings, bind_grpc_ingress
    from cluster.http.ingress import OpenAIIngress
    from cluster.replica.llm_server import LLMServer

    with OtlpReceiver() as receiver:
        config = ServeConfig.from_flat(
            grpc_drain_s=TEST_GRPC_DRAIN_S,
            otlp_endpoint=receiver.endpoint,
            kv_cache_memory_bytes=KV_CACHE_BYTES,
            max_num_seqs=8,
        )
        grpc_port = free_port()
        llm = serve.deployment(LLMServer, **llm_server_options(config)).bind(config)
        grpc_ingress = bind_grpc_ingress(
            config, llm, GrpcSettings(host="127.0.0.1", port=grpc_port, drain_s=TEST_GRPC_DRAIN_S)
        )
        ingress = serve.deployment(OpenAIIngress, **ingress_options(config))
        name, prefix = "kvray-traced", "/traced"
        serve.run(ingress.bind(config, llm, grpc_ingress), name=name, route_prefix=prefix)
        try:
            wait_serving(grpc_port)
            app = App(
                name,
                f"http://127.0.0.1:{serve_ports.http}{prefix}",
                config.engine.model_name(),
                None,
            )
            yield Traced(app, receiver, *send_both(app, grpc_port))
        finally:
            serve.delete(name)


def trace_of(receiver: OtlpReceiver, trace_id: str) -> dict[str, list[ReceivedSpan]]:
    """The spans of one trace by name, once its engine phases have arrived (each process
    exports in the background, every few seconds)."""

    def spans() -> list[ReceivedSpan]:
        return [s for s in receiver.spans() if s.trace_id == trace_id]

    wait_for(
        lambda: (
            {"kvray.engine.decode"} <= {s.name for s in spans()}
            and any(
                s.kind == "SPAN_KIND_SERVER" and s.parent_span_id == PARENT_SPAN for s in spans()
            )
        ),
        f"the spans of trace {trace_id}",
        timeout_s=60,
    )
    by_name: dict[str, list[ReceivedSpan]] = {}
    for s in spans():
        by_name.setdefault(s.name, []).append(s)
    return by_name


def check_chain(by_name: dict[str, list[ReceivedSpan]], server_name: str, model: str) -> None:
    """server -> kvray.route -> kvray.replica.generate -> the engine's phases, one each."""
    assert set(by_name) == {server_name, "kvray.route", "kvray.replica.generate", *ENGINE_PHASES}
    assert all(len(v) == 1 for v in by_name.values()), by_name
    server = by_name[server_name][0]
    route = by_name["kvray.route"][0]
    replica = by_name["kvray.replica.generate"][0]
    assert server.parent_span_id == PARENT_SPAN  # the caller's span
    assert route.parent_span_id == server.span_id
    assert replica.parent_span_id == route.span_id
    for phase in ENGINE_PHASES:
        assert by_name[phase][0].parent_span_id == replica.span_id

    assert route.attributes["kvray.router"] == "prefix_affinity"
    assert route.attributes["kvray.migration.attempt"] == 0
    assert replica.attributes["kvray.replica"]
    assert replica.attributes["gen_ai.request.model"] == model
    assert replica.attributes["gen_ai.usage.input_tokens"] > 0
    assert 0 < replica.attributes["gen_ai.usage.output_tokens"] <= MAX_TOKENS
    assert replica.attributes["gen_ai.response.finish_reasons"][0] in ("stop", "length")
    assert replica.attributes["kvray.usage.cached_tokens"] >= 0
    assert replica.attributes["kvray.request_id"] == route.attributes["kvray.request_id"]
    queue, prefill, decode = (by_name[p][0] for p in ENGINE_PHASES)
    assert queue.start_ns <= queue.end_ns == prefill.start_ns <= prefill.end_ns
    assert prefill.end_ns == decode.start_ns <= decode.end_ns
    for s in (server, route, replica, queue):
        assert s.status != "STATUS_CODE_ERROR"
        assert s.resource["service.name"] == "kvray"
    assert replica.resource["kvray.deployment"] == "LLMServer"


def test_an_http_request_is_one_trace_under_its_traceparent(traced: Traced) -> None:
    assert traced.http_chunks > 0
    by_name = trace_of(traced.receiver, HTTP_TRACE)
    check_chain(by_name, "POST /v1/chat/completions", traced.app.model)
    server = by_name["POST /v1/chat/completions"][0]
    assert server.kind == "SPAN_KIND_SERVER"
    assert server.attributes["http.response.status_code"] == 200
    assert server.resource["kvray.deployment"] == "OpenAIIngress"


def test_a_grpc_call_is_one_trace_under_its_traceparent(traced: Traced) -> None:
    assert traced.grpc_completions == 1
    by_name = trace_of(traced.receiver, GRPC_TRACE)
    check_chain(by_name, "kvray.v1.LLMService/Generate", traced.app.model)
    server = by_name["kvray.v1.LLMService/Generate"][0]
    assert server.attributes["rpc.grpc.status_code"] == 0
    assert server.resource["kvray.deployment"] == "GrpcIngress"


def test_every_span_belongs_to_a_callers_trace(traced: Traced) -> None:
    # The probes, the readiness poll and model-card fetches are not traced: only requests.
    assert {s.trace_id for s in traced.receiver.spans()} <= {HTTP_TRACE, GRPC_TRACE}

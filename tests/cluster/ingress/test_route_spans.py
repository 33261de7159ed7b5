"""cluster/ingress/route_spans.py through LLMClient: one `kvray.route` span per attempt under
the caller's server span, the request carrying that span's context to the replica; off, the
request goes as it came. The handle is a stand-in (the live test, tests/cluster/
test_tracing_live.py, runs the real one): its first replica dies, the second answers."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from cluster.errors import EngineDeadError
from cluster.ingress.llm_client import LLMClient
from cluster.ingress.route_spans import ROUTE_SPAN, RouteSpans
from cluster.messages import GenerateRequest
from cluster.tracing import Tracing
from workers import SamplingParams
from workers.inputs import InputChecker
from workers.outputs import CompletionOutput, RequestOutput


class Stream:
    def __init__(self, request: GenerateRequest, fail: bool) -> None:
        self.request, self.fail = request, fail

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        return self._outputs()

    async def _outputs(self) -> AsyncIterator[RequestOutput]:
        if self.fail:
            raise EngineDeadError("engine died: test", replica="rep-a")
        done = CompletionOutput(0, "hi", [5], "stop", delta_text="hi", delta_token_ids=[5])
        yield RequestOutput(self.request.request_id, None, [1, 2, 3], [done], finished=True)

    def cancel(self) -> None:
        pass


class Handle:
    """Serve's DeploymentHandle as LLMClient uses it; the first `failures` calls die."""

    def __init__(self, failures: int = 0) -> None:
        self.failures = failures
        self.sent: list[GenerateRequest] = []

    def options(self, **_: Any) -> Handle:
        return self

    @property
    def generate(self) -> Handle:
        return self

    def remote(self, request: GenerateRequest) -> Stream:
        self.sent.append(request)
        return Stream(request, fail=len(self.sent) <= self.failures)


def request() -> GenerateRequest:
    params = SamplingParams(max_tokens=4, temperature=0.0)
    inp = InputChecker(vocab_size=1000, max_model_len=64).check([1, 2, 3], params)
    return GenerateRequest("req-1", inp)


async def consume(client: LLMClient, req: GenerateRequest) -> list[RequestOutput]:
    return [out async for out in client.generate(req)]


def test_off_the_request_goes_as_it_came() -> None:
    handle = Handle()
    req = request()
    asyncio.run(consume(LLMClient(handle), req))
    assert handle.sent == [req] and handle.sent[0].trace_context is None


def test_each_attempt_is_a_route_span_under_the_server_span() -> None:
    exporter = InMemorySpanExporter()
    tracing = Tracing.with_exporter(exporter, "OpenAIIngress", batch=False)
    handle = Handle(failures=1)
    client = LLMClient(handle, spans=RouteSpans(tracing, "prefix_affinity"))

    async def run() -> None:
        server = tracing.start_span("POST /v1/completions", None, kind="server")
        with tracing.current(server):
            outs = await consume(client, request())
        server.end()
        assert outs[-1].finished

    asyncio.run(run())
    spans = exporter.get_finished_spans()
    failed, answered, server = spans
    assert [s.name for s in (failed, answered)] == [ROUTE_SPAN, ROUTE_SPAN]
    for route in (failed, answered):
        assert route.parent.span_id == server.context.span_id
        assert route.attributes["kvray.router"] == "prefix_affinity"
    assert failed.attributes["kvray.migration.attempt"] == 0
    assert failed.attributes["kvray.replica"] == "rep-a"
    assert failed.attributes["error.type"] == "EngineDeadError"
    assert not failed.status.is_ok
    assert answered.attributes["kvray.migration.attempt"] == 1
    assert answered.attributes["kvray.migration.excluded_replicas"] == ("rep-a",)
    assert answered.status.is_unset
    # Each replica got its attempt's span as the parent to hang its own span under.
    for sent, route in zip(handle.sent, (failed, answered), strict=True):
        assert f"{route.context.span_id:016x}" in sent.trace_context["traceparent"]
    assert [e.name for e in server.events] == ["kvray.migration"]

"""cluster/replica/engine_spans.py: the replica span and the engine's phases built from a
request's RequestMetrics, checked with the SDK's in-memory exporter. The live test
(tests/cluster/test_tracing_live.py) checks them from a real engine."""

from __future__ import annotations

import asyncio
import time

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from cluster.config import ServeConfig
from cluster.errors import QueueTimeoutError
from cluster.messages import GenerateRequest
from cluster.replica.engine_spans import (
    DECODE_SPAN,
    PREFILL_SPAN,
    QUEUE_SPAN,
    REPLICA_SPAN,
    ReplicaSpans,
    engine_phases,
    replica_spans,
)
from cluster.tracing import Tracing
from workers import SamplingParams
from workers.inputs import InputChecker
from workers.outputs import CompletionOutput, RequestMetrics, RequestOutput

TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


@pytest.fixture
def exporter() -> InMemorySpanExporter:
    return InMemorySpanExporter()


@pytest.fixture
def spans(exporter: InMemorySpanExporter) -> ReplicaSpans:
    return ReplicaSpans(Tracing.with_exporter(exporter, "LLMServer", batch=False), "rep-1", "m")


def request(traced: bool = True, migration: int = 0) -> GenerateRequest:
    params = SamplingParams(max_tokens=8, temperature=0.5, n=2)
    inp = InputChecker(vocab_size=1000, max_model_len=64).check([1, 2, 3, 4], params)
    context = {"traceparent": TRACEPARENT} if traced else None
    return GenerateRequest("req-9", inp, trace_context=context, migration=migration)


def final_output(m: RequestMetrics | None) -> RequestOutput:
    outs = [CompletionOutput(0, "a", [5], "stop"), CompletionOutput(1, "b", [6, 7], "length")]
    return RequestOutput("req-9", None, [1, 2, 3, 4], outs, True, num_cached_tokens=2, metrics=m)


def metrics(t0: float) -> RequestMetrics:
    return RequestMetrics(
        arrival_time=t0,
        first_scheduled_time=t0 + 0.010,
        first_token_time=t0 + 0.030,
        finished_time=t0 + 0.100,
        num_prompt_tokens=4,
        num_generation_tokens=3,
        num_cached_tokens=2,
    )


def test_an_untraced_request_makes_no_span(spans: ReplicaSpans) -> None:
    assert spans.start(request(traced=False), queued=0) is None


def test_off_without_an_endpoint() -> None:
    assert replica_spans(ServeConfig(), "rep-1", "m") is None


def test_replica_span_and_engine_phases(
    spans: ReplicaSpans, exporter: InMemorySpanExporter
) -> None:
    span = spans.start(request(migration=1), queued=3)
    assert span is not None
    t0 = time.monotonic()
    try:
        spans.finished(span, final_output(metrics(t0)))
    finally:
        spans.end(span, finished=True)
    by_name = {s.name: s for s in exporter.get_finished_spans()}
    assert set(by_name) == {REPLICA_SPAN, QUEUE_SPAN, PREFILL_SPAN, DECODE_SPAN}
    replica = by_name[REPLICA_SPAN]
    assert format(replica.parent.span_id, "016x") == "b7ad6b7169203331"
    assert replica.status.is_ok
    attrs = dict(replica.attributes)
    assert attrs["kvray.request_id"] == "req-9"
    assert attrs["kvray.replica"] == "rep-1"
    assert attrs["gen_ai.request.model"] == "m"
    assert attrs["gen_ai.request.choice.count"] == 2
    assert attrs["kvray.migration.attempt"] == 1
    assert attrs["kvray.replica.queued"] == 3
    assert attrs["gen_ai.usage.input_tokens"] == 4
    assert attrs["gen_ai.usage.output_tokens"] == 3
    assert attrs["kvray.usage.cached_tokens"] == 2
    assert attrs["gen_ai.response.finish_reasons"] == ("stop", "length")
    for name in (QUEUE_SPAN, PREFILL_SPAN, DECODE_SPAN):
        assert by_name[name].parent.span_id == replica.context.span_id
    # Monotonic times on the wall clock through one offset: the phases' edges line up.
    queue, prefill, decode = by_name[QUEUE_SPAN], by_name[PREFILL_SPAN], by_name[DECODE_SPAN]
    assert queue.start_time == spans.wall_ns(t0)
    assert queue.end_time == prefill.start_time and prefill.end_time == decode.start_time
    assert decode.end_time - queue.start_time == pytest.approx(100_000_000, abs=10)
    assert abs(queue.start_time - time.time_ns()) < 10**9  # near now, on the wall clock
    assert prefill.attributes["kvray.usage.cached_tokens"] == 2
    assert decode.attributes["gen_ai.usage.output_tokens"] == 3


def test_phases_of_a_request_that_never_ran() -> None:
    m = RequestMetrics(arrival_time=1.0, finished_time=3.0)
    assert [(n, s, e) for n, s, e, _ in engine_phases(m)] == [(QUEUE_SPAN, 1.0, 3.0)]
    m = RequestMetrics(arrival_time=1.0, first_scheduled_time=2.0, finished_time=3.0)
    assert [n for n, *_ in engine_phases(m)] == [QUEUE_SPAN, PREFILL_SPAN]
    assert engine_phases(RequestMetrics(arrival_time=1.0)) == []


def test_a_failure_is_recorded(spans: ReplicaSpans, exporter: InMemorySpanExporter) -> None:
    span = spans.start(request(), queued=0)
    assert span is not None
    with pytest.raises(QueueTimeoutError):
        try:
            raise QueueTimeoutError("waited too long")
        finally:
            spans.end(span, finished=True)  # a queue timeout comes with a final output
    (s,) = exporter.get_finished_spans()
    assert not s.status.is_ok
    assert s.attributes["error.type"] == "QueueTimeoutError"
    assert [e.name for e in s.events] == ["exception"]


def test_a_cancellation_is_marked_not_failed(
    spans: ReplicaSpans, exporter: InMemorySpanExporter
) -> None:
    span = spans.start(request(), queued=0)
    assert span is not None
    with pytest.raises(asyncio.CancelledError):
        try:
            raise asyncio.CancelledError()
        finally:
            spans.end(span, finished=False)
    (s,) = exporter.get_finished_spans()
    assert s.status.is_unset and s.attributes["kvray.cancelled"] is True


def test_a_sampled_out_request_builds_no_phases(exporter: InMemorySpanExporter) -> None:
    spans = ReplicaSpans(Tracing.with_exporter(exporter, "x", 0.0, batch=False), "r", "m")
    req = request()
    unsampled = GenerateRequest(
        "x", req.input, trace_context={"traceparent": TRACEPARENT[:-2] + "00"}
    )
    span = spans.start(unsampled, queued=0)
    assert span is not None and not span.is_recording()
    spans.finished(span, final_output(metrics(time.monotonic())))
    spans.end(span, finished=True)
    assert exporter.get_finished_spans() == ()

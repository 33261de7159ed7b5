"""cluster/tracing.py: the switch (off: None, nothing imported or made), the W3C propagation,
parent-based sampling, the exporter's URL and its missing-package error, and the migration
event, with the SDK's in-memory exporter."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import AsyncIterator

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from cluster.config import ServeConfig
from cluster.errors import EngineDeadError
from cluster.ingress.migration import migrating
from cluster.messages import GenerateRequest
from cluster.tracing import (
    OTEL_EXTRA,
    Tracing,
    TracingUnavailableError,
    exporter_missing,
    migration_event,
    setup_tracing,
    traces_url,
)
from workers import SamplingParams
from workers.inputs import InputChecker
from workers.outputs import CompletionOutput, RequestOutput

TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
TRACEPARENT = f"00-{TRACE_ID}-b7ad6b7169203331-01"


def tracing(ratio: float = 1.0) -> tuple[Tracing, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    return Tracing.with_exporter(exporter, "test", ratio, batch=False), exporter


def request(trace_context: dict[str, str] | None = None) -> GenerateRequest:
    inp = InputChecker(vocab_size=1000, max_model_len=64).check([1, 2, 3], SamplingParams())
    return GenerateRequest("r1", inp, trace_context=trace_context)


def test_off_without_an_endpoint() -> None:
    assert setup_tracing(ServeConfig(), "OpenAIIngress") is None
    assert exporter_missing(ServeConfig()) is None


def test_on_with_an_endpoint_exports_over_otlp() -> None:
    t = setup_tracing(ServeConfig.from_flat(otlp_endpoint="http://127.0.0.1:9"), "LLMServer")
    assert t is not None
    assert t.provider.resource.attributes["service.name"] == "kvray"
    assert t.provider.resource.attributes["kvray.deployment"] == "LLMServer"
    t.provider.shutdown()  # nothing was recorded: nothing to send to the closed port


def test_the_endpoint_is_a_collector_base_url_or_a_full_one() -> None:
    assert traces_url("http://collector:4318") == "http://collector:4318/v1/traces"
    assert traces_url("http://collector:4318/") == "http://collector:4318/v1/traces"
    assert traces_url("https://x.example/otlp/v1/traces") == "https://x.example/otlp/v1/traces"


@pytest.mark.parametrize(
    ("field", "value"),
    [("otlp_endpoint", "collector:4318"), ("otlp_endpoint", "ftp://c"), ("otlp_sample_ratio", 2)],
)
def test_bad_settings_name_the_field(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        ServeConfig.from_flat(**{field: value})


def test_a_missing_exporter_names_the_extra() -> None:
    # A None entry in sys.modules makes the import fail as if the package were not installed.
    code = (
        "import sys\n"
        "sys.modules['opentelemetry.exporter.otlp.proto.http.trace_exporter'] = None\n"
        "from cluster.config import ServeConfig\n"
        "from cluster.tracing import exporter_missing, setup_tracing\n"
        "config = ServeConfig.from_flat(otlp_endpoint='http://127.0.0.1:4318')\n"
        "print(exporter_missing(config))\n"  # what `kvray serve` checks before it starts
        "setup_tracing(config, 'x')\n"  # what a replica meets on a cluster without it
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert run.returncode != 0
    assert "--otlp-endpoint needs the OTLP exporter" in run.stdout and OTEL_EXTRA in run.stdout
    assert "TracingUnavailableError" in run.stderr and OTEL_EXTRA in run.stderr
    assert exporter_missing(ServeConfig.from_flat(otlp_endpoint="http://127.0.0.1:4318")) is None
    assert issubclass(TracingUnavailableError, RuntimeError)


def test_an_incoming_traceparent_is_the_parent_and_travels_on() -> None:
    t, exporter = tracing()
    server = t.start_span("server", {"traceparent": TRACEPARENT}, kind="server")
    carrier = t.carrier(server)
    child = t.start_span("child", carrier)  # as another process would, from the carrier
    child.end()
    server.end()
    child_s, server_s = exporter.get_finished_spans()
    assert format(server_s.context.trace_id, "032x") == TRACE_ID
    assert format(server_s.parent.span_id, "016x") == "b7ad6b7169203331"
    assert child_s.context.trace_id == server_s.context.trace_id
    assert child_s.parent.span_id == server_s.context.span_id
    assert carrier["traceparent"].startswith(f"00-{TRACE_ID}-")


def test_no_or_a_malformed_traceparent_starts_a_new_trace() -> None:
    t, exporter = tracing()
    for carrier in (None, {}, {"traceparent": "garbage"}):
        t.start_span("s", carrier).end()
    spans = exporter.get_finished_spans()
    assert all(s.parent is None for s in spans)
    assert len({s.context.trace_id for s in spans}) == 3


def test_the_ambient_span_is_the_current_one_only_inside_the_block() -> None:
    t, _ = tracing()
    span = t.start_span("server", None)
    assert t.current_carrier() == {}
    with t.current(span):
        assert t.current_carrier() == t.carrier(span)
    assert t.current_carrier() == {}
    span.end()


def test_sampling_follows_the_parent_and_the_ratio_for_new_traces() -> None:
    t, exporter = tracing(ratio=0.0)
    t.start_span("new trace", None).end()  # ratio 0: dropped
    t.start_span("sampled parent", {"traceparent": TRACEPARENT}).end()
    unsampled = TRACEPARENT[:-2] + "00"
    t.start_span("unsampled parent", {"traceparent": unsampled}).end()
    assert [s.name for s in exporter.get_finished_spans()] == ["sampled parent"]


def test_migration_event_on_the_ambient_span() -> None:
    t, exporter = tracing()
    server = t.start_span("server", None)
    with t.current(server):
        err = EngineDeadError("engine died", cause="engine_died", replica="rep-a")
        migration_event(request({}), err, attempt=1, tokens=7)
        migration_event(request(None), err, attempt=2, tokens=9)  # not traced: nothing
    server.end()
    (span,) = exporter.get_finished_spans()
    (event,) = span.events
    assert event.name == "kvray.migration"
    assert dict(event.attributes) == {
        "kvray.migration.cause": "engine_died",
        "kvray.migration.replica_left": "rep-a",
        "kvray.migration.attempt": 1,
        "kvray.migration.tokens": 7,
    }


def test_a_migrated_request_leaves_an_event_per_move() -> None:
    """The real `migrating` loop: the first replica dies before any output, the second answers."""
    t, exporter = tracing()
    calls: list[GenerateRequest] = []

    async def attempt(req: GenerateRequest) -> AsyncIterator[RequestOutput]:
        calls.append(req)
        if len(calls) == 1:
            raise EngineDeadError("engine died: test", replica="rep-a")
        done = CompletionOutput(0, "hi", [5], "stop", delta_text="hi", delta_token_ids=[5])
        yield RequestOutput(req.request_id, None, [1, 2, 3], [done], finished=True)

    async def run() -> list[RequestOutput]:
        server = t.start_span("server", None)
        with t.current(server):
            req = request(t.current_carrier())
            outs = [out async for out in migrating(attempt, req, max_migrations=3)]
        server.end()
        return outs

    outs = asyncio.run(run())
    assert outs[-1].finished and outs[-1].outputs[0].text == "hi"
    assert calls[1].exclude_replicas == frozenset({"rep-a"})
    (span,) = exporter.get_finished_spans()
    assert [e.name for e in span.events] == ["kvray.migration"]
    assert span.events[0].attributes["kvray.migration.replica_left"] == "rep-a"

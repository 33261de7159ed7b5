"""The engine replica's spans of a traced request: the replica's own, and the engine's phases.

`LLMServer.generate` opens `kvray.replica.generate` (kind server) under the context its
request carries (`GenerateRequest.trace_context`, the ingress's `kvray.route` span) once the
request is admitted, and closes it when the call ends: finished, failed (the error recorded)
or cancelled. On the final output the engine's phases become its children, built from the
timestamps the engine already keeps per request (`workers.outputs.RequestMetrics`), so the
engine itself carries no tracing code:

    kvray.engine.queue    arrival        -> first scheduled   (waiting for a batch slot, KV)
    kvray.engine.prefill  first scheduled -> first token      (the prompt's forward passes)
    kvray.engine.decode   first token    -> finished          (the other tokens)

The engine's timestamps are `time.monotonic()` of its process (this replica's thread, or its
child process on the same host: one clock); they become wall-clock times through one offset
taken when the replica starts. A preempted request's re-prefill falls in its decode span.
"""

from __future__ import annotations

import sys
import time
from typing import TYPE_CHECKING, Any

from cluster.tracing import setup_tracing

if TYPE_CHECKING:
    from opentelemetry.trace import Span

    from cluster.config import ServeConfig
    from cluster.messages import GenerateRequest
    from cluster.tracing import Tracing
    from workers.outputs import RequestMetrics, RequestOutput

REPLICA_SPAN = "kvray.replica.generate"
QUEUE_SPAN = "kvray.engine.queue"
PREFILL_SPAN = "kvray.engine.prefill"
DECODE_SPAN = "kvray.engine.decode"


class ReplicaSpans:
    """One replica's spans; LLMServer holds one when tracing is on, None otherwise."""

    def __init__(self, tracing: Tracing, replica: str, model: str) -> None:
        self.tracing = tracing
        self.replica = replica
        self.model = model
        # monotonic -> wall clock, in ns: taken once, so every span of this replica agrees.
        self.offset_ns = time.time_ns() - time.monotonic_ns()

    def start(self, request: GenerateRequest, queued: int) -> Span | None:
        """The replica span of an admitted request (`queued`: the waiting samples it found
        here), or None when the request is not traced."""
        if request.trace_context is None:
            return None
        params = request.input.params
        attributes: dict[str, Any] = {
            "kvray.request_id": request.request_id,
            "kvray.replica": self.replica,
            "gen_ai.request.model": self.model,
            "gen_ai.request.temperature": float(params.temperature),
            "gen_ai.request.top_p": float(params.top_p),
            "gen_ai.request.choice.count": params.n,
            "kvray.migration.attempt": request.migration,
            "kvray.replica.queued": queued,
        }
        if params.max_tokens is not None:  # None: the rest of the context
            attributes["gen_ai.request.max_tokens"] = params.max_tokens
        if request.input.resume:
            attributes["kvray.migration.resumed_samples"] = len(request.input.resume)
        return self.tracing.start_span(
            REPLICA_SPAN, request.trace_context, kind="server", attributes=attributes
        )

    def finished(self, span: Span, out: RequestOutput) -> None:
        """The final output: token counts and finish reasons on the replica span, and the
        engine's phases under it."""
        if not span.is_recording():  # sampled out: nobody will see them
            return
        span.set_attribute(
            "gen_ai.response.finish_reasons", [c.finish_reason or "" for c in out.outputs]
        )
        span.set_attribute("kvray.usage.cached_tokens", out.num_cached_tokens)
        m = out.metrics
        if m is None:
            return
        span.set_attribute("gen_ai.usage.input_tokens", m.num_prompt_tokens)
        span.set_attribute("gen_ai.usage.output_tokens", m.num_generation_tokens)
        for name, start, end, attributes in engine_phases(m):
            child = self.tracing.start_child(
                name, span, attributes=attributes, start_ns=self.wall_ns(start)
            )
            child.end(end_time=self.wall_ns(end))

    def end(self, span: Span, finished: bool) -> None:
        """Closes the replica span; call it from the `finally` of the request's handling:
        the exception leaving (sys.exc_info) is recorded, a cancellation is marked."""
        err = sys.exc_info()[1]
        if isinstance(err, Exception):  # a queue timeout has a final output, and fails
            self.tracing.set_error(span, err)
        elif err is not None and not finished:  # CancelledError, GeneratorExit
            span.set_attribute("kvray.cancelled", True)
        span.end()

    def wall_ns(self, monotonic_s: float) -> int:
        return round(monotonic_s * 1e9) + self.offset_ns


def engine_phases(m: RequestMetrics) -> list[tuple[str, float, float, dict[str, Any]]]:
    """(span name, start, end, attributes) of each phase the request went through, in
    monotonic seconds: queue, prefill, decode (module doc). A request aborted before it was
    scheduled has a queue phase only; one that ended before a token, no decode."""
    end = m.finished_time
    if end is None:
        return []
    phases: list[tuple[str, float, float, dict[str, Any]]] = []
    scheduled, first = m.first_scheduled_time, m.first_token_time
    phases.append((QUEUE_SPAN, m.arrival_time, scheduled if scheduled is not None else end, {}))
    if scheduled is None:
        return phases
    prefill = {
        "gen_ai.usage.input_tokens": m.num_prompt_tokens,
        "kvray.usage.cached_tokens": m.num_cached_tokens,
    }
    phases.append((PREFILL_SPAN, scheduled, first if first is not None else end, prefill))
    if first is not None:
        decode = {"gen_ai.usage.output_tokens": m.num_generation_tokens}
        phases.append((DECODE_SPAN, first, end, decode))
    return phases


def replica_spans(config: ServeConfig, replica: str, model: str) -> ReplicaSpans | None:
    """A replica's ReplicaSpans when tracing is on (its own TracerProvider), else None."""
    tracing = setup_tracing(config, "LLMServer")
    return None if tracing is None else ReplicaSpans(tracing, replica, model)

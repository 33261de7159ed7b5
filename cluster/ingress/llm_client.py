"""LLMClient: how both ingresses call the LLMServer deployment, so both behave the same.

    client = LLMClient(handle)
    checker = await client.input_checker()         # the served model's limits (cached)
    async with contextlib.aclosing(client.generate(GenerateRequest(...))) as outs:
        async for out in outs: ...                 # workers.outputs.RequestOutput

- Transport: a streaming handle with plain pickle both ways. The messages are plain
  dataclasses, and cloudpickle's per-object hook costs the replica a large share of its time.
- Output kind: whatever the request's SamplingParams ask for (cluster/ingress/checks.py):
  deltas for a streamed call, the final output only otherwise, so a non-streamed request
  sends nothing per token over the Serve hop.
- Coalescing: a streamed call's outputs that arrive while the consumer is still writing the
  previous one (to a socket, an SSE frame, a gRPC message) are merged into one
  (cluster/coalesce.py); the replica paces its own yields by the stream interval.
- Cancellation: leaving the stream early (client gone, deadline, error) cancels the Serve
  call; Serve delivers that to the replica, which aborts the engine request and frees its
  KV blocks.
- Errors: everything a handle call raises leaves as a cluster.errors class, through the one
  mapping (`cluster.errors.as_kvray_error`).
- Migration: a request whose replica dies (EngineDeadError) continues on another replica,
  token-exact, up to `max_migrations` times (cluster/ingress/migration.py). It sits below
  the coalescing, so it sees every output once.
- Tracing (`spans`, None when off): each attempt is a `kvray.route` span under the caller's
  server span, whose context the request carries to the replica (cluster/ingress/route_spans.py).
- Disaggregation (`prefill`: the prefill deployment's handle, with `pd` its policy): an
  attempt may run the prompt on a prefill replica first and the rest on a decode replica
  (cluster/ingress/pd.py). It sits below migration, so a moved request is one attempt too.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from cluster.coalesce import coalesced
from cluster.config.replicas import DEFAULT_MAX_MIGRATIONS
from cluster.errors import as_kvray_error
from cluster.ingress.checks import is_streamed
from cluster.ingress.migration import migrating
from cluster.ingress.pd import Disaggregation
from cluster.routing.replica_loads import replica_loads
from workers.inputs import InputChecker

if TYPE_CHECKING:
    from cluster.ingress.pd import PdPolicy
    from cluster.ingress.route_spans import RouteSpans
    from cluster.messages import GenerateRequest
    from workers.outputs import RequestOutput


class LLMClient:
    """One ingress replica's view of the LLMServer deployment (a DeploymentHandle)."""

    def __init__(
        self,
        handle: Any,
        max_migrations: int = DEFAULT_MAX_MIGRATIONS,
        metrics: Any = None,
        queue_timeout_s: float | None = None,
        spans: RouteSpans | None = None,
        prefill: Any = None,
        pd: PdPolicy | None = None,
        pd_metrics: Any = None,
    ) -> None:
        # metrics: cluster.routing.metrics.RouterMetrics (migrations), or None (unit use).
        # queue_timeout_s: how long a request waits for a replica that can take it.
        self.handle = handle
        self.max_migrations = max_migrations
        self.metrics = metrics
        self.queue_timeout_s = queue_timeout_s
        self.spans = spans  # tracing (cluster/ingress/route_spans.py); None: off
        self._stream_handle = _streaming(handle)
        self._card: dict[str, Any] | None = None
        self._checker: InputChecker | None = None
        self._pd: Disaggregation | None = None
        if prefill is not None and pd is not None:
            prefill_handle = _streaming(prefill)
            self._pd = Disaggregation(
                pd,
                lambda r: self._attempt(r, prefill_handle),
                self._attempt,
                self.input_checker,
                pd_metrics,
                lambda inp: (
                    replica_loads(self._stream_handle, inp),
                    replica_loads(prefill_handle, inp),
                ),
            )

    async def model_card(self) -> dict[str, Any]:
        """{"id", "max_model_len", "vocab_size", "created"} from LLMServer; fetched once (it
        never changes)."""
        if self._card is None:
            try:
                self._card = await self.handle.model_card.remote()
            except Exception as err:
                raise as_kvray_error(err) from None
        return self._card

    async def input_checker(self) -> InputChecker:
        """The served model's limits, as the engine has them: its vocabulary (the embedding's
        rows, which can outnumber the tokenizer's tokens) and its context length."""
        if self._checker is None:
            card = await self.model_card()
            self._checker = InputChecker(
                vocab_size=int(card["vocab_size"]),
                max_model_len=int(card["max_model_len"]),
                kv_cache_tokens=card.get("kv_cache_tokens"),
            )
        return self._checker

    def generate(self, request: GenerateRequest) -> AsyncIterator[RequestOutput]:
        """LLMServer.generate's outputs; errors come out as cluster.errors classes."""
        if self.spans is not None:
            request = self.spans.traced(request)  # under the caller's span, taken now
        attempt = self._attempt if self._pd is None else self._pd.attempt
        outputs = (
            migrating(attempt, request, self.max_migrations, self.metrics, self.queue_timeout_s)
            if self.max_migrations
            else attempt(request)  # migration off: no resume state kept per output
        )
        if is_streamed(request.input.params):
            return coalesced(outputs)
        return outputs  # one output, the final one: nothing to merge

    async def _attempt(
        self, request: GenerateRequest, handle: Any = None
    ) -> AsyncIterator[RequestOutput]:
        """One call to one replica: of the decode (or only) deployment unless `handle` (a
        streaming handle of another) says otherwise."""
        gen = None
        finished = False
        spans, span = self.spans, None
        if spans is not None:
            span, request = spans.start(request)
        try:
            # Serve may refuse at once (BackPressureError): inside the try, so it maps to 429.
            gen = (handle or self._stream_handle).generate.remote(request)
            async for out in gen:
                finished = out.finished
                yield out
        except Exception as err:
            error = as_kvray_error(err)
            if spans is not None and span is not None:
                spans.failed(span, error)
            raise error from None
        finally:
            if gen is not None and not finished:
                gen.cancel()  # the consumer left (or we failed): abort the engine request
            if spans is not None and span is not None:
                spans.end(span, finished)


def _streaming(handle: Any) -> Any:
    return handle.options(
        stream=True, request_serialization="pickle", response_serialization="pickle"
    )

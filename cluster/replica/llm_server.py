"""LLMServer: one engine replica (one AsyncEngine with its TP group) behind Ray Serve.

`cluster.deploy.app.build_app` wraps this plain class with `serve.deployment(name="LLMServer")`;
ingresses (HTTP, gRPC) call it through a DeploymentHandle, via cluster/ingress/llm_client.py:

    gen = handle.options(stream=True).generate.remote(request)   # a GenerateRequest
    async for out in gen: ...                # workers.outputs.RequestOutput

The request (cluster/messages.py) was checked at the ingress into the engine's own
types; this replica trusts it and hands it to `AsyncEngine.generate_input` as is. The engine
produces the output kind the request's SamplingParams ask for: deltas for a streamed call
(the last output, finished=True, carries everything, metrics included), or the finished
output alone for a call that is not streamed.

Errors are `cluster.errors` classes (QueueFullError, EngineDeadError), raised before the
first output. Cancelling the caller (Ray Serve turns it into asyncio.CancelledError inside
this replica) aborts the engine request and frees its KV blocks.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from cluster.coalesce import coalesced
from cluster.config import ServeConfig, resolve_model_dir
from cluster.errors import (
    EngineDeadError,
    InvalidRequestError,
    KvrayError,
    QueueFullError,
    QueueTimeoutError,
    invalid_from_value_error,
)
from cluster.replica.deadline import with_deadline
from cluster.replica.engine_restart import EngineSupervisor
from cluster.replica.engine_spans import replica_spans
from cluster.replica.gateway_metrics import gateway_metrics
from cluster.replica.kv_publish import kv_publisher
from cluster.replica.kv_share import replica_kv_share
from cluster.replica.model_card import model_card
from cluster.replica.queued_tokens import QueuedTokens
from cluster.replica.replica_process import node_id, replica_name, use_reserved_cpus
from cluster.replica.tenant_share import TenantShare
from workers.outputs import RequestOutputKind, ended_unrun, is_queue_timeout
from workers.structured import GRAMMAR_ERROR

if TYPE_CHECKING:
    from cluster.messages import GenerateRequest
    from workers.core.stats import EngineStats
    from workers.outputs import RequestOutput

logger = logging.getLogger("ray.serve.kvray.llm_server")

# How often the replica pushes engine gauges and per-step token counts to Prometheus.
STATS_INTERVAL_S = 1.0
# Streamed messages per second a replica aims for across all its streams. Each message costs
# every hop to the client (~1 ms of CPU over ingress and proxy, measured on the demo model), so
# with N streams each one waits N / STREAM_MESSAGES_PER_S between chunks, capped by
# `stream_interval_ms`: a lone stream gets every token at once, a busy replica sends fewer,
# larger chunks instead of spending its CPU on messages.
STREAM_MESSAGES_PER_S = 300.0


class LLMServer:
    """One engine replica. Public methods are what the ingresses call through the handle."""

    async def __init__(self, config: ServeConfig) -> None:
        from cluster.replica.metrics import EngineMetrics
        from workers import AsyncEngine, EngineArgs

        self._config = config
        model_dir = resolve_model_dir(config)
        logger.info("LLMServer: loading %s (tp=%d)", model_dir, config.engine.tensor_parallel_size)
        # TP = 1 runs the forward pass in the engine core, so the core gets its own process
        # (its own GIL); TP > 1 runs it in the ranks' actors, and the core stays a thread.
        process = config.replicas.engine_process and config.engine.tensor_parallel_size == 1
        use_reserved_cpus(config.replicas.torch_threads())
        args = EngineArgs(**config.engine_kwargs(model_dir))
        # The engine, restarted in place should its child process die (engine_restart.py).
        self._supervisor = EngineSupervisor(
            lambda: AsyncEngine(args, process=process),
            AsyncEngine(args, process=process),
            on_restart=self._engine_restarted,
        )
        self._model_name = config.engine.model_name()
        self._created = int(time.time())
        # Samples of the generate() calls in flight here (a request counts n): with the
        # engine's running count, what the waiting queue behind admission control holds.
        self._in_flight = 0
        # Prompt tokens waiting here, against max_queued_tokens (cluster/replica/queued_tokens.py).
        self._queued_tokens = QueuedTokens(config.limits.max_queued_tokens)
        self._share = TenantShare()  # each tenant's share of a full queue (tenant_share.py)
        # Streamed generate() calls in flight: what the chunk interval follows.
        self._streams = 0
        self._replica = replica_name()
        self._metrics = EngineMetrics(model=self._model_name, replica=self._replica)
        # Tracing (cluster/replica/engine_spans.py); None: off, nothing traced.
        self._spans = replica_spans(config, self._replica, self._model_name)
        # vLLM-named gauges for inference gateways (gateway_metrics.py; engine_metrics_port).
        self._gateway = gateway_metrics(config, lambda: self._engine.stats(), self._queued)
        self._stats_task = asyncio.get_running_loop().create_task(self._push_stats_forever())
        self._supervise_task = asyncio.get_running_loop().create_task(self._supervisor.run())
        # KV events for the kv_events router, through routing stats (None: another router).
        self._kv = kv_publisher(config, self._engine)
        # The cluster KV tier (cluster/replica/kv_share.py; None: off).
        self._kv_share = replica_kv_share(config, args, self._metrics.kv_share)
        if self._kv_share is not None:
            self._kv_share.listen(self._engine)
        import torch

        # torch threads follow the CPUs this replica reserves (num_cpus_per_replica).
        logger.info(
            "LLMServer ready: model=%s max_model_len=%d engine=%s torch_threads=%d",
            self._model_name,
            self.max_model_len,
            "thread" if self._engine.in_process else "child process",
            torch.get_num_threads(),
        )

    @property
    def _engine(self) -> Any:  # workers.AsyncEngine: the supervisor's current one
        return self._supervisor.engine

    def _engine_restarted(self, engine: Any) -> None:
        # A new engine has an empty cache: a new KV-event epoch tells the routers so.
        self._kv = kv_publisher(self._config, engine)
        if self._kv_share is not None:
            self._kv_share.listen(engine)

    @property
    def max_model_len(self) -> int:
        return int(self._engine.max_model_len)

    async def generate(self, request: GenerateRequest) -> AsyncIterator[RequestOutput]:
        """Streams the engine's RequestOutputs of one checked request (module doc).

        Raises QueueFullError (waiting queue at `max_queued_requests`, or its prompt tokens
        past `max_queued_tokens`), QueueTimeoutError (not
        started within `queue_timeout_s`, the time since the ingress sent it included) or
        EngineDeadError before the first output; RequestTimeoutError once the request has
        run `request_timeout_s` (it is aborted).
        """
        if self._supervisor.restarting or not self._engine.healthy:
            # Nothing ran here: the ingress waits for a replica, or moves the request, without
            # charging it a migration.
            raise EngineDeadError(
                "engine is restarting" if self._supervisor.restarting else "engine is not running",
                replica=self._replica,
                taken=False,
            )
        inp = request.input
        streamed = inp.params.output_kind is RequestOutputKind.DELTA
        queue_timeout_s = self._queue_time_left(request)
        queued = self._queued()
        if not self._share.admits(inp, queued, self._config.limits.max_queued_requests):
            raise QueueFullError(
                f"too many requests waiting on this replica ({queued} >= "
                f"max_queued_requests={self._config.limits.max_queued_requests}); retry later",
                replica=self._replica,  # the ingress tries another replica first
            )
        if request.migration:
            logger.info(
                "request %s: migration %d lands here (replica %s), %d samples resumed",
                request.request_id,
                request.migration,
                self._replica,
                len(inp.resume),
            )
        # Samples this call counts in `_in_flight`: a resumed request runs only its unfinished.
        held = len(inp.resume) or inp.params.n
        try:
            self._share.enter(
                self._queued_tokens, request.request_id, inp, held, self._engine.stats()
            )
        except QueueFullError as err:  # its prompt tokens: named, as above
            err.replica = self._replica
            raise
        self._in_flight += held
        self._streams += streamed
        self._gateway.track(request.request_id, inp.lora)
        spans = self._spans
        span = spans.start(request, queued) if spans is not None else None
        finished = cancelled = False
        try:
            # A peer's blocks of its prompt, when worth pulling: only the engine holds them
            # (kept here, they would pin their objects in the store for the whole request).
            rid, share = request.request_id, self._kv_share
            engine_inp = inp if share is None else await share.attach(inp, rid, request.handoff)
            stream = self._engine.generate_input(engine_inp, rid, queue_timeout_s)
            del engine_inp  # the stream drops it too, once the core has it
            if self._config.limits.request_timeout_s is not None:
                stream = with_deadline(stream, self._config.limits.request_timeout_s)
            if streamed:
                # Outputs that pile up while Serve ships the previous one travel as one message.
                stream = coalesced(stream, self._interval)
            async with contextlib.aclosing(stream):
                async for out in stream:
                    self._share.started(request.request_id)
                    if out.finished:
                        finished = True
                        # Out of the count now, not when Serve closes this generator later.
                        self._in_flight -= held
                        held = 0
                        if is_queue_timeout(out):  # never started: nothing was yielded
                            raise self._queue_timeout()
                        if ended_unrun(out, GRAMMAR_ERROR):  # never started either
                            raise InvalidRequestError(
                                "structured_outputs",
                                "structured_outputs: the constraint could not be compiled "
                                "within grammar_timeout_s "
                                f"({self._config.engine.grammar_timeout_s:g} s)",
                            )
                        self._metrics.observe_finished(out, inp.lora)
                        if self._kv_share is not None:
                            self._kv_share.observe_finished(out)
                            if request.handoff == "prefill":  # a decode replica pulls them
                                await self._kv_share.flushed()
                        if spans is not None and span is not None:
                            spans.finished(span, out)
                    yield out
        except ValueError as err:  # the engine refused it (e.g. a request id already in use)
            raise invalid_from_value_error(err, default_field="prompt") from None
        except (asyncio.CancelledError, GeneratorExit):
            cancelled = True
            raise
        except EngineDeadError as err:  # the engine's: `_engine_error` names this replica
            raise self._engine_error(err) from err
        except KvrayError:
            raise
        except Exception as err:
            raise self._engine_error(err) from err
        finally:
            self._streams -= streamed
            self._in_flight -= held
            self._queued_tokens.release(request.request_id)
            self._share.left(request.request_id)
            self._gateway.untrack(request.request_id)
            if not finished:
                # Caller went away (disconnect, cancel) or we failed: free the KV blocks now.
                self._engine.abort(request.request_id)
                if cancelled:
                    self._metrics.observe_aborted(inp.lora)
            if spans is not None and span is not None:
                spans.end(span, finished)  # records the error leaving, if any

    def _queue_time_left(self, request: GenerateRequest) -> float | None:
        """What is left of queue_timeout_s once the time before this replica took the
        request (Serve's router queue) is counted; None: no limit."""
        limit = self._config.limits.queue_timeout_s
        if not limit:
            return None
        # Wall clocks of the ingress's node and this one: a skew shifts this by its size.
        left = limit - max(0.0, time.time() - request.sent_at)
        if left <= 0:
            raise self._queue_timeout()
        return left

    def _queue_timeout(self) -> QueueTimeoutError:
        limit = self._config.limits.queue_timeout_s
        return QueueTimeoutError(
            f"the request waited longer than queue_timeout_s ({limit:g} s) to start: the "
            "server is overloaded; retry later",
            retry_after_s=max(1, round(limit / 4)),
        )

    def _queued(self) -> int:
        """Samples in flight here that the engine is not running yet: the waiting queue.

        Counted from the engine's running count (sequences, so samples here too) rather
        than from each request's first output: a request that is not streamed has no output
        before it finishes. The engine's count is its last step's, so a burst is seen at
        once (it adds to `_in_flight`) and a finished request leaves with its final output.
        """
        return max(0, self._in_flight - self._engine.stats().num_requests_running)

    def _interval(self) -> float:
        return chunk_interval_s(self._streams, self._config.replicas.stream_interval_ms)

    async def model_card(self) -> dict[str, Any]:
        """/v1/models, ListModels and the ingresses' request limits (model_card.py)."""
        return model_card(self._model_name, self._engine, self._created)

    async def stats(self) -> EngineStats:
        return self._engine.stats()

    async def replica_stats(self, route: dict[str, Any] | None = None) -> dict[str, Any]:
        """EngineStats fields plus this replica's id and queue: for tests, benches, debugging.

        `route` is read only by the router: {"routing_key": K} sends the call to the replica
        that K prefers, which is how a caller reaches every replica (a load-aware router
        would otherwise keep answering from the idlest one).
        """
        stats = self._engine.stats()
        return {
            "replica": self._replica,
            "queued": self._queued(),
            "queued_tokens": self._queued_tokens.waiting(stats),
            "engine_core": "thread" if self._engine.in_process else "process",
            "engine_pid": self._engine.engine_pid,
            "pid": os.getpid(),
            "node_id": node_id(),
            **({"kv_share": self._kv_share.stats()} if self._kv_share is not None else {}),
            **dataclasses.asdict(stats),
        }

    async def check_health(self) -> None:
        """Ray Serve's health hook: raising marks the replica unhealthy and gets it replaced.

        First the engine's cheap progress check (work pending and no step completed in
        step_timeout_s is unhealthy), then the full check (TP > 1: a blocking ping of every
        rank) on a worker thread, so this event loop's streams never wait for it."""
        self._check_alive(full=False)  # fails fast, without a thread hop
        await asyncio.to_thread(self._check_alive)

    async def record_routing_stats(self) -> dict[str, Any]:
        """Ray Serve's routing-stats hook: load as the prefix-affinity router reads it."""
        s = self._engine.stats()
        return {
            "queued": self._queued(),
            "waiting": s.num_requests_waiting,
            "running": s.num_requests_running,
            "kv_cache_usage": float(s.kv_cache_usage),
            "max_queued_requests": self._config.limits.max_queued_requests,
            "queued_tokens": self._queued_tokens.waiting(s),
            "max_queued_tokens": self._config.limits.max_queued_tokens,
            # A dead engine fails fast, so it looks least loaded: the router drops it.
            "engine_alive": bool(self._engine.healthy) and not self._supervisor.restarting,
            # The adapters in the engine's device slots (lora_int_ids): the router sends an
            # adapter's requests where it is loaded (cluster/routing/lora_policy.py).
            "lora_adapters": tuple(s.lora_adapters),
            "lora_slots_free": s.lora_slots_total - s.lora_slots_used,
            **({"kv": self._kv.publish()} if self._kv is not None else {}),
            **({"kv_rates": self._kv_share.rates()} if self._kv_share is not None else {}),
        }

    async def record_autoscaling_stats(self) -> dict[str, float]:
        """Ray Serve's autoscaling-stats hook: the load LLMAutoscalingPolicy scales on
        (cluster/controller/autoscaling.py), the engine stats the dashboard's gauges show."""
        from cluster.controller.autoscaling import scaling_stats

        s = self._engine.stats()
        return scaling_stats(
            s.num_requests_waiting, s.kv_cache_usage, self._queued_tokens.waiting(s)
        )

    def __del__(self) -> None:
        for name in ("_stats_task", "_supervise_task"):
            task = getattr(self, name, None)
            if task is not None:
                task.cancel()
        supervisor = getattr(self, "_supervisor", None)
        if supervisor is not None:
            with contextlib.suppress(Exception):
                supervisor.engine.shutdown()

    # -- internals -----------------------------------------------------------------------

    def _check_alive(self, full: bool = True) -> None:
        sup = self._supervisor
        if sup.restarting or (not sup.engine.healthy and not sup.gave_up):
            return  # a dead engine child is being restarted in place: not for Serve to replace
        try:
            if full:
                self._engine.check_health()
            else:
                self._engine.check_progress()
        except Exception as err:
            raise EngineDeadError(f"engine is not running: {err}") from None

    def _engine_error(self, err: BaseException) -> KvrayError:
        if not self._engine.healthy:
            # Named, so the ingress migrates the request to another replica than this one.
            return EngineDeadError(f"engine died: {err}", replica=self._replica)
        return KvrayError(f"internal error: {err}")

    async def _push_stats_forever(self) -> None:
        while True:
            try:
                self._metrics.observe_stats(self._engine.stats())
                # Waits for the engine thread's next command slot: off this event loop.
                counts = await asyncio.to_thread(self._engine.pop_step_token_counts)
                self._metrics.observe_step_tokens(counts)
            except Exception:  # metrics must never take the replica down
                logger.exception("pushing engine stats failed")
            await asyncio.sleep(STATS_INTERVAL_S)


def chunk_interval_s(streams: int, cap_ms: int) -> float:
    """Least seconds between two chunks of one stream when `streams` stream from this replica:
    each gets its share of STREAM_MESSAGES_PER_S, never waiting more than `cap_ms`."""
    return min(cap_ms / 1000, streams / STREAM_MESSAGES_PER_S)

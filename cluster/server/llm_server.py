"""LLMServer: one engine replica (one AsyncEngine with its TP group) behind Ray Serve.

`cluster.app.build_app` wraps this plain class with `serve.deployment(name="LLMServer")`;
ingresses (HTTP, gRPC) call it through a DeploymentHandle:

    gen = handle.options(stream=True).generate.remote(request)
    async for out in gen: ...                # workers.outputs.RequestOutput

Running outputs carry only what changed (delta_text, delta_token_ids, delta_logprobs,
finish_reason of samples that just finished); their cumulative fields (text, token_ids,
logprobs, prompt_token_ids) are empty. The last output (finished=True) carries everything,
metrics included.

The request is a plain dict so both ingresses build it the same way:

    {"request_id": str,
     "prompt": str | list[int] | None,        # text or token ids
     "messages": list[dict] | None,           # chat: rendered with the checkpoint's template
     "params": dict,                          # SamplingParams keyword arguments
     "stream": bool,                          # default True; False: only the final output
     "routing_key": str | None}               # optional; see cluster.server.router

Errors are `cluster.errors` classes (InvalidRequestError, QueueFullError, EngineDeadError),
raised before the first output is yielded. Cancelling the caller (Ray Serve turns it into
asyncio.CancelledError inside this replica) aborts the engine request and frees its KV blocks.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from cluster.config import ServeConfig
from cluster.errors import (
    EngineDeadError,
    InvalidRequestError,
    KvrayError,
    QueueFullError,
    invalid_from_value_error,
)
from cluster.server.coalesce import coalesced
from workers.outputs import deltas_only

if TYPE_CHECKING:
    from workers.outputs import RequestOutput
    from workers.stats import EngineStats

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
        from cluster.server.metrics import EngineMetrics
        from workers import AsyncEngine, EngineArgs

        self._config = config
        model_dir = resolve_model_dir(config)
        logger.info("LLMServer: loading %s (tp=%d)", model_dir, config.tensor_parallel_size)
        # TP = 1 runs the forward pass in the engine core, so the core gets its own process
        # (its own GIL); TP > 1 runs it in the ranks' actors, and the core stays a thread.
        process = config.engine_process and config.tensor_parallel_size == 1
        self._engine = AsyncEngine(engine_args(EngineArgs, config, model_dir), process=process)
        self._model_name = config.model_name()
        self._created = int(time.time())
        # Requests admitted to this replica that have not produced their first output yet:
        # the bounded waiting queue behind admission control (429 beyond the cap).
        self._queued = 0
        # Streaming generate() calls in flight: what the chunk interval follows.
        self._streams = 0
        self._replica = _replica_name()
        self._metrics = EngineMetrics(model=self._model_name, replica=self._replica)
        self._stats_task = asyncio.get_running_loop().create_task(self._push_stats_forever())
        import torch

        # Ray sets OMP_NUM_THREADS to the CPUs reserved for this replica: CPU compute uses them.
        logger.info(
            "LLMServer ready: model=%s max_model_len=%d engine=%s torch_threads=%d",
            self._model_name,
            self.max_model_len,
            "thread" if self._engine.in_process else "child process",
            torch.get_num_threads(),
        )

    @property
    def max_model_len(self) -> int:
        return int(self._engine.max_model_len)

    async def generate(self, request: dict[str, Any]) -> AsyncIterator[RequestOutput]:
        """Streams RequestOutputs (deltas + cumulative); the last one is finished, with metrics.

        Raises InvalidRequestError (bad field; names it), QueueFullError (waiting queue at
        `max_queued_requests`) or EngineDeadError before the first output.
        """
        request_id = str(request.get("request_id") or uuid.uuid4().hex)
        stream_deltas = bool(request.get("stream", True))
        prompt = self._prompt(request)
        params = sampling_params(request.get("params") or {})
        if self._queued >= self._config.max_queued_requests:
            raise QueueFullError(
                f"too many requests waiting on this replica ({self._queued} >= "
                f"max_queued_requests={self._config.max_queued_requests}); retry later"
            )
        self._queued += 1
        self._streams += stream_deltas
        waiting = True
        finished = cancelled = False
        try:
            # Outputs that pile up while Serve ships the previous one travel as one message.
            stream = coalesced(self._engine.generate(prompt, params, request_id), self._interval)
            async with contextlib.aclosing(stream):
                async for out in stream:
                    if waiting:
                        waiting = False
                        self._queued -= 1
                    if out.error:
                        raise self._engine_error(RuntimeError(out.error))
                    if out.finished:
                        finished = True
                        self._metrics.observe_finished(out)
                    elif not stream_deltas:
                        continue
                    else:
                        out = deltas_only(out)
                    yield out
        except ValueError as err:
            raise invalid_from_value_error(err, default_field="prompt") from None
        except (asyncio.CancelledError, GeneratorExit):
            cancelled = True
            raise
        except KvrayError:
            raise
        except Exception as err:
            raise self._engine_error(err) from err
        finally:
            self._streams -= stream_deltas
            if waiting:
                self._queued -= 1
            if not finished:
                # Caller went away (disconnect, cancel) or we failed: free the KV blocks now.
                self._engine.abort(request_id)
                if cancelled:
                    self._metrics.observe_aborted()

    def _interval(self) -> float:
        return chunk_interval_s(self._streams, self._config.stream_interval_ms)

    async def tokenize(self, request: dict[str, Any]) -> list[int]:
        """Token ids of {"prompt": str} or {"messages": [...], "add_generation_prompt": bool}."""
        if request.get("messages") is not None:
            return self._chat_ids(request["messages"], request.get("add_generation_prompt", True))
        prompt = request.get("prompt")
        if not isinstance(prompt, str):
            raise InvalidRequestError("prompt", "prompt must be a string")
        return list(self._engine.tokenizer.encode(prompt))

    async def detokenize(self, ids: list[int]) -> str:
        """Text of token ids (special tokens skipped)."""
        check_token_ids(ids, self._engine.tokenizer.vocab_size, "tokens")
        return self._engine.tokenizer.decode(list(ids))

    async def model_card(self) -> dict[str, Any]:
        """{"id", "max_model_len", "created"} for /v1/models and ListModels."""
        return {
            "id": self._model_name,
            "max_model_len": self.max_model_len,
            "created": self._created,
        }

    async def stats(self) -> EngineStats:
        return self._engine.stats()

    async def replica_stats(self, route: dict[str, Any] | None = None) -> dict[str, Any]:
        """EngineStats fields plus this replica's id and queue: for tests, benches, debugging.

        `route` is read only by the router: {"routing_key": K} sends the call to the replica
        that K prefers, which is how a caller reaches every replica (a load-aware router
        would otherwise keep answering from the idlest one).
        """
        return {
            "replica": self._replica,
            "queued": self._queued,
            "engine_core": "thread" if self._engine.in_process else "process",
            **dataclasses.asdict(self._engine.stats()),
        }

    async def check_health(self) -> None:
        """Ray Serve's health hook: raising marks the replica unhealthy and gets it replaced."""
        self._check_alive()

    async def record_routing_stats(self) -> dict[str, Any]:
        """Ray Serve's routing-stats hook: load as the prefix-affinity router reads it."""
        s = self._engine.stats()
        return {
            "queued": self._queued,
            "waiting": s.num_requests_waiting,
            "running": s.num_requests_running,
            "kv_cache_usage": float(s.kv_cache_usage),
            "max_queued_requests": self._config.max_queued_requests,
        }

    def __del__(self) -> None:
        task = getattr(self, "_stats_task", None)
        if task is not None:
            task.cancel()
        engine = getattr(self, "_engine", None)
        if engine is not None:
            with contextlib.suppress(Exception):
                engine.shutdown()

    # -- internals -----------------------------------------------------------------------

    def _prompt(self, request: dict[str, Any]) -> str | list[int]:
        messages = request.get("messages")
        if messages is not None:
            return self._chat_ids(messages, True)
        prompt = request.get("prompt")
        if isinstance(prompt, str):
            if prompt == "":
                raise InvalidRequestError("prompt", "prompt must not be empty")
            return prompt
        if isinstance(prompt, list) and prompt:
            check_token_ids(prompt, self._engine.tokenizer.vocab_size, "prompt")
            return [int(t) for t in prompt]
        raise InvalidRequestError(
            "prompt", "prompt must be a non-empty string or list of token ids"
        )

    def _chat_ids(self, messages: Any, add_generation_prompt: bool) -> list[int]:
        if not isinstance(messages, list) or not messages:
            raise InvalidRequestError("messages", "messages must be a non-empty list")
        try:
            return list(
                self._engine.tokenizer.apply_chat_template(
                    messages, add_generation_prompt=add_generation_prompt
                )
            )
        except ValueError as err:
            raise InvalidRequestError("messages", str(err)) from None

    def _check_alive(self) -> None:
        try:
            self._engine.check_health()
        except Exception as err:
            raise EngineDeadError(f"engine is not running: {err}") from None

    def _engine_error(self, err: BaseException) -> KvrayError:
        if not self._engine.healthy:
            return EngineDeadError(f"engine died: {err}")
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


def resolve_model_dir(config: ServeConfig) -> str:
    """The checkpoint directory on this node: config.model, or the built-in demo model."""
    if config.model:
        return config.model
    from workers.demo import demo_model_dir

    return str(demo_model_dir())


def engine_args(engine_args_cls: Any, config: ServeConfig, model_dir: str) -> Any:
    """EngineArgs for one replica; `device` "auto" leaves the engine to pick (cuda if visible)."""
    return engine_args_cls(
        model=model_dir,
        tensor_parallel_size=config.tensor_parallel_size,
        max_model_len=config.max_model_len,
        enable_prefix_caching=config.enable_prefix_caching,
        kv_cache_memory_bytes=config.kv_cache_memory_bytes,
        max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens,
        served_model_name=config.model_name(),
        device=None if config.device == "auto" else config.device,
    )


def sampling_params(params: dict[str, Any]) -> Any:
    """SamplingParams from request kwargs; unknown names and bad values name the field."""
    from workers import SamplingParams

    if not isinstance(params, dict):
        raise InvalidRequestError("params", "params must be a mapping")
    if "eos_token_ids" in params:
        raise InvalidRequestError("eos_token_ids", "eos_token_ids is set by the engine")
    try:
        return SamplingParams(**params)
    except TypeError as err:
        bad = next((k for k in params if k not in SamplingParams.__dataclass_fields__), None)
        raise InvalidRequestError(bad, f"unknown sampling parameter {bad!r}: {err}") from None
    except ValueError as err:
        raise invalid_from_value_error(err) from None


def check_token_ids(ids: Any, vocab_size: int, field: str) -> None:
    if not isinstance(ids, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab_size for t in ids
    ):
        raise InvalidRequestError(
            field, f"{field} must be a list of token ids in [0, {vocab_size})"
        )


def _replica_name() -> str:
    from ray import serve

    try:
        return serve.get_replica_context().replica_id.unique_id
    except Exception:  # outside Serve (unit use): one unnamed replica
        return "local"

"""OpenAIIngress: the OpenAI-compatible HTTP API (FastAPI) in front of the LLMServer replicas.

The ingress tokenizes (prompts and chat templates) so the prefix-affinity router sees token
ids, the engine replicas spend no time on it, and logprob tokens can be rendered here. A
request reaches an engine replica as the dict documented in cluster/server/llm_server.py; its
RequestOutputs come back as a Ray Serve stream and leave as SSE frames or one JSON body.
Errors leave as OpenAI's error body with the status of their cluster.errors class.

Client disconnects: Ray Serve's proxy cancels the ingress request; the cancellation reaches
`_generate`, which cancels the LLMServer call, whose replica aborts the engine request.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from ray import serve
from ray.serve.handle import DeploymentHandle

from cluster.config import ServeConfig
from cluster.errors import (
    EngineDeadError,
    InvalidRequestError,
    KvrayError,
    ModelNotFoundError,
    QueueFullError,
    unwrap,
)
from cluster.http.format import SSE_DONE, Formatter, TokenStrings, sse
from cluster.http.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from cluster.ingress.auth import ApiKeyAuth
from cluster.server.coalesce import coalesced
from cluster.server.llm_server import resolve_model_dir

logger = logging.getLogger("ray.serve.kvray.openai")

READY_TIMEOUT_S = 5.0


@serve.ingress()
class OpenAIIngress:
    """The HTTP ingress deployment; `build_app` binds it to the LLMServer handle."""

    def __init__(self, config: ServeConfig, llm: DeploymentHandle, grpc: Any = None) -> None:
        # `grpc` (the GrpcIngress handle) is bound here only so Serve deploys it with the app.
        from cluster.server.metrics import RouterMetrics
        from workers.tokenizer import Tokenizer

        self.config = config
        self.llm = llm
        self.model = config.model_name()
        self.tokenizer = Tokenizer.from_pretrained(resolve_model_dir(config))
        self.token_strings = TokenStrings(
            lambda ids: self.tokenizer.decode(ids, skip_special_tokens=False)
        )
        self.auth = ApiKeyAuth.from_env(config.api_key_env)
        # Plain pickle for the (gRPC) handle transport: the outputs are plain dataclasses,
        # and cloudpickle's per-object hook costs the replica a large share of its time.
        self._stream_handle = llm.options(
            stream=True, request_serialization="pickle", response_serialization="pickle"
        )
        self.metrics = RouterMetrics()
        self._card: dict[str, Any] | None = None
        logger.info("OpenAIIngress ready: model=%s auth=%s", self.model, self.auth.enabled)

    def __serve_build_asgi_app__(self) -> Any:
        return StatusCounter(build_api(self), self.metrics)

    # -- pieces the routes use ---------------------------------------------------------------

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model:
            raise ModelNotFoundError(model)

    def encode(self, prompt: str | list[int], field: str = "prompt") -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError(field, f"{field} must not be empty")
            return list(self.tokenizer.encode(prompt))
        if not prompt:
            raise InvalidRequestError(field, f"{field} must not be empty")
        vocab = self.tokenizer.vocab_size
        if not all(0 <= t < vocab for t in prompt):
            raise InvalidRequestError(field, f"{field} token ids must be in [0, {vocab})")
        return list(prompt)

    def chat_ids(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True
    ) -> list[int]:
        try:
            return list(
                self.tokenizer.apply_chat_template(
                    messages, add_generation_prompt=add_generation_prompt
                )
            )
        except ValueError as err:
            raise InvalidRequestError("messages", str(err)) from None

    async def model_card(self) -> dict[str, Any]:
        if self._card is None:
            self._card = await self.llm.model_card.remote()
        return self._card

    async def generate(self, request: dict[str, Any]) -> AsyncIterator[Any]:
        """RequestOutputs of one LLMServer request; errors come out as cluster.errors."""
        gen = None
        finished = False
        try:
            # Serve may refuse at once (BackPressureError): inside the try, so it maps to 429.
            gen = self._stream_handle.generate.remote(request)
            async for out in gen:
                finished = out.finished
                yield out
        except Exception as err:
            raise as_kvray_error(err) from None
        finally:
            if gen is not None and not finished:
                gen.cancel()

    async def run(
        self,
        fmt: Formatter,
        prompts: Sequence[list[int]],
        params: dict[str, Any],
        stream: bool,
        include_usage: bool,
    ) -> Any:
        """Starts one engine request per prompt and answers with JSON or an SSE stream."""
        many = len(prompts) > 1
        streams = [
            coalesced(
                self.generate(
                    {
                        "request_id": f"{fmt.id}-{i}" if many else fmt.id,
                        "prompt": ids,
                        "params": params,
                        "stream": stream,
                    }
                )
            )
            for i, ids in enumerate(prompts)
        ]
        try:
            # The first output of every prompt before answering: errors (400/429/503) become
            # a status code, not a broken stream.
            firsts = await _first_of_each(streams)
        except BaseException:
            await _close_all(streams)
            raise
        if not stream:
            try:
                finals = [await _last(s, first) for s, first in zip(streams, firsts, strict=True)]
            finally:
                await _close_all(streams)
            return JSONResponse(fmt.response(finals))
        return StreamingResponse(
            _sse(fmt, streams, firsts, include_usage),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache"},
        )


def build_api(ingress: OpenAIIngress) -> FastAPI:
    """The FastAPI app of one ingress replica; routes close over `ingress`."""

    async def authorize(request: Request) -> None:
        # The path below the app's route prefix (Serve passes the prefix as root_path).
        path, root = request.scope.get("path", ""), request.scope.get("root_path", "")
        if root and path.startswith(root):
            path = path[len(root) :] or "/"
        ingress.auth.check_path(path, request.headers.get("authorization"))

    app = FastAPI(title="kvray", dependencies=[Depends(authorize)])

    @app.exception_handler(KvrayError)
    async def _kvray_error(_: Request, err: KvrayError) -> JSONResponse:
        return error_response(err, ingress.metrics)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, err: RequestValidationError) -> JSONResponse:
        return error_response(validation_to_invalid(err), ingress.metrics)

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/ready")
    async def ready() -> JSONResponse:
        try:
            await asyncio.wait_for(ingress.llm.check_health.remote(), READY_TIMEOUT_S)
        except Exception as err:  # no healthy engine replica answered in time
            return JSONResponse({"status": "not ready", "reason": str(err)[:200]}, status_code=503)
        return JSONResponse({"status": "ready"})

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        card = await ingress.model_card()
        return {
            "object": "list",
            "data": [
                {
                    "id": card["id"],
                    "object": "model",
                    "created": card["created"],
                    "owned_by": "kvray",
                    "root": card["id"],
                    "max_model_len": card["max_model_len"],
                }
            ],
        }

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest) -> Any:
        ingress.check_model(body.model)
        params = body.sampling_params()
        prompts = [ingress.encode(p) for p in body.prompts()]
        fmt = Formatter(
            "completion",
            f"cmpl-{uuid.uuid4().hex}",
            ingress.model,
            body.n,
            body.logprobs,
            ingress.token_strings,
        )
        return await ingress.run(fmt, prompts, params, body.stream, body.include_usage)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest) -> Any:
        ingress.check_model(body.model)
        params = body.sampling_params()
        ids = ingress.chat_ids(body.template_messages(), body.add_generation_prompt)
        top = (body.top_logprobs or 0) if body.logprobs else None
        fmt = Formatter(
            "chat",
            f"chatcmpl-{uuid.uuid4().hex}",
            ingress.model,
            body.n,
            top,
            ingress.token_strings,
        )
        try:
            return await ingress.run(fmt, [ids], params, body.stream, body.include_usage)
        except InvalidRequestError as err:
            if err.param == "prompt":  # the rendered messages are the prompt
                err.param = "messages"
            raise

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        ingress.check_model(body.model)
        if body.messages is not None:
            ids = ingress.chat_ids(
                [m.as_template_input() for m in body.messages], body.add_generation_prompt
            )
        elif body.prompt is not None:
            ids = list(ingress.tokenizer.encode(body.prompt))
        else:
            raise InvalidRequestError("prompt", "send prompt or messages")
        card = await ingress.model_card()
        return {"tokens": ids, "count": len(ids), "max_model_len": card["max_model_len"]}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict[str, Any]:
        ingress.check_model(body.model)
        vocab = ingress.tokenizer.vocab_size
        if not all(0 <= t < vocab for t in body.tokens):
            raise InvalidRequestError("tokens", f"token ids must be in [0, {vocab})")
        return {"prompt": ingress.tokenizer.decode(body.tokens)}

    return app


# -- streaming helpers ------------------------------------------------------------------------


async def _first_of_each(streams: Sequence[AsyncIterator[Any]]) -> list[Any]:
    if len(streams) == 1:
        return [await anext(streams[0])]
    tasks = [asyncio.ensure_future(anext(s)) for s in streams]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        # On failure stop the others, so their generators are idle and can be closed.
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _last(stream: AsyncIterator[Any], first: Any) -> Any:
    out = first
    async for out in stream:  # noqa: B007 - only the last (finished) output matters
        pass
    return out


async def _close_all(streams: Sequence[Any]) -> None:
    for s in streams:
        with contextlib.suppress(Exception):
            await s.aclose()


async def _merge(streams: Sequence[AsyncIterator[Any]]) -> AsyncIterator[tuple[int, Any]]:
    """(prompt index, output) from several streams as they arrive."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    queue: asyncio.Queue[tuple[int, Any, BaseException | None]] = asyncio.Queue()
    done = object()

    async def pump(i: int, s: AsyncIterator[Any]) -> None:
        try:
            async for out in s:
                await queue.put((i, out, None))
            await queue.put((i, done, None))
        except BaseException as err:  # handed to the consumer, which re-raises it
            await queue.put((i, done, err))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        live = len(streams)
        while live:
            i, out, err = await queue.get()
            if err is not None:
                raise err
            if out is done:
                live -= 1
                continue
            yield i, out
    finally:
        for t in tasks:
            t.cancel()


async def _sse(
    fmt: Formatter,
    streams: Sequence[AsyncIterator[Any]],
    firsts: Sequence[Any],
    include_usage: bool,
) -> AsyncIterator[str]:
    finals = list(firsts)
    try:
        head = "".join(f for i, first in enumerate(firsts) for f in fmt.chunks(first, i))
        if head:
            yield head
        async for i, out in _merge(streams):
            finals[i] = out
            frames = fmt.chunks(out, i)
            if frames:
                yield "".join(frames)
        if include_usage:
            yield fmt.usage_chunk(finals)
    except KvrayError as err:  # mid-stream failure: the status line is already sent
        yield sse(err.to_openai())
    finally:
        await _close_all(streams)
    yield SSE_DONE


# -- errors -----------------------------------------------------------------------------------


def as_kvray_error(err: BaseException) -> KvrayError:
    """Maps what a handle call can raise onto cluster.errors."""
    inner = unwrap(err)
    if isinstance(inner, KvrayError):
        return inner
    from ray.exceptions import RayActorError
    from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError

    if isinstance(inner, BackPressureError):
        return QueueFullError("too many requests queued for the engine replicas; retry later")
    if isinstance(inner, (RayActorError, DeploymentUnavailableError)):
        return EngineDeadError(f"engine replica unavailable: {type(inner).__name__}")
    logger.exception("unexpected error from LLMServer", exc_info=err)
    return KvrayError(f"internal error: {type(inner).__name__}: {inner}")


def error_response(err: KvrayError, metrics: Any) -> JSONResponse:
    headers = {}
    if isinstance(err, QueueFullError):
        headers["Retry-After"] = str(err.retry_after_s)
        metrics.rejected("queue_full")
    elif err.http_status == 401:
        metrics.rejected("unauthenticated")
    return JSONResponse(err.to_openai(), status_code=err.http_status, headers=headers)


def validation_to_invalid(err: RequestValidationError) -> InvalidRequestError:
    """A pydantic error -> 400 naming the field (dotted path below the body)."""
    errors = err.errors()
    if not errors:
        return InvalidRequestError(None, "invalid request body")
    first = errors[0]
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    # Union members add their type name to the path (e.g. prompt.str); keep the field only.
    field = loc[0] if loc else None
    return InvalidRequestError(field, f"{'.'.join(loc) or 'body'}: {first.get('msg', 'invalid')}")


class StatusCounter:
    """ASGI wrapper counting responses by status code (kvray_router_requests_total)."""

    def __init__(self, app: FastAPI, metrics: Any) -> None:
        self.app = app
        self.metrics = metrics

    def __getattr__(self, name: str) -> Any:  # Ray Serve adds exception handlers to the app
        return getattr(self.app, name)

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope.get("type") != "http":
            await self.app(scope, receive, send)
            return

        async def send_counting(message: dict[str, Any]) -> None:
            if message.get("type") == "http.response.start":
                self.metrics.request("http", str(message.get("status", 0)))
            await send(message)

        await self.app(scope, receive, send_counting)

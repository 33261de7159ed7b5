"""OpenAIIngress: the OpenAI-compatible HTTP API (FastAPI) in front of the LLMServer replicas.

Each request is checked here, once, into the engine's own types by the preparation both
ingresses share (cluster/ingress/prepare.py: prompts tokenized, chat rendered with the
template, SamplingParams, tools and output constraint checked, token ids checked against the
served model) before it is routed, so a bad field is a 400 without a Serve hop. It
reaches an engine replica as a `cluster.messages.GenerateRequest` through the shared
`cluster.ingress.llm_client.LLMClient`; its RequestOutputs come back and leave as SSE frames
(cluster/http/streams.py) or one JSON body (cluster/http/format.py). Errors leave as
OpenAI's error body with the status of their cluster.errors class.

Client disconnects: Ray Serve's proxy cancels the ingress request; the cancellation reaches
the LLMClient stream, which cancels the LLMServer call, whose replica aborts the engine
request.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel
from ray import serve
from ray.serve.handle import DeploymentHandle
from starlette.exceptions import HTTPException as StarletteHTTPException

from cluster.config import ServeConfig, resolve_model_dir, resolve_tokenizer
from cluster.errors import (
    DrainingError,
    InvalidRequestError,
    KvrayError,
    QueueFullError,
    QueueTimeoutError,
)
from cluster.http import streams
from cluster.http.echo import prompt_echo
from cluster.http.embeddings import add_embeddings_route
from cluster.http.format import Formatter
from cluster.http.gateway_hint import GatewayHint, hinted
from cluster.http.guard import RequestGuard, api_path
from cluster.http.lora_routes import add_lora_routes
from cluster.http.messages_errors import from_status, is_messages_path
from cluster.http.messages_route import add_messages_routes
from cluster.http.messages_route import error_response as messages_error
from cluster.http.protocol import ChatCompletionRequest, CompletionRequest
from cluster.http.responses_format import ResponsesFormatter
from cluster.http.responses_route import add_responses_route
from cluster.http.token_routes import add_token_routes
from cluster.http.tracing import traced_app
from cluster.ingress import checks
from cluster.ingress.embeddings import hidden_size
from cluster.ingress.limits import RequestLimits
from cluster.ingress.llm_client import LLMClient
from cluster.ingress.lora_catalog import AdapterCheck, LoraCatalog
from cluster.ingress.output_parsing import OutputParsing
from cluster.ingress.pd import pd_client_kwargs
from cluster.ingress.prepare import Prepared, Preparer
from cluster.ingress.prompts import Prompts
from cluster.ingress.route_spans import route_spans
from cluster.ingress.tenant_gate import TenantGate
from cluster.ingress.tenants import TenantAuth, current_tenant
from cluster.ingress.token_text import TokenStrings

logger = logging.getLogger("ray.serve.kvray.openai")

READY_TIMEOUT_S = 5.0


@serve.ingress()
class OpenAIIngress:
    """The HTTP ingress deployment; `build_app` binds it to the LLMServer handle."""

    def __init__(
        self, config: ServeConfig, llm: DeploymentHandle, grpc: Any = None, prefill: Any = None
    ) -> None:
        # `grpc` (the GrpcIngress handle) is bound here only so Serve deploys it with the app;
        # `prefill`: the prefill replicas' deployment (cluster/ingress/pd.py), None: none.
        from cluster.routing.metrics import RouterMetrics
        from workers.tokenizer import Tokenizer

        self.config = config
        self.llm = llm
        self.model = config.engine.model_name()
        tokenizer = Tokenizer.from_pretrained(resolve_tokenizer(config))
        self.prompts = Prompts(tokenizer)
        # What /v1/embeddings' `dimensions` must equal (cluster/ingress/embeddings.py).
        self.embedding_size = hidden_size(resolve_model_dir(config))
        self.token_strings = TokenStrings.of(tokenizer)
        self.metrics = RouterMetrics()
        # Tracing (cluster/http/tracing.py, cluster/ingress/route_spans.py); None: off.
        self.spans = route_spans(config, "OpenAIIngress")
        self.client = LLMClient(
            llm,
            config.replicas.max_migrations,
            self.metrics,
            queue_timeout_s=config.limits.queue_timeout_s,
            spans=self.spans,
            **pd_client_kwargs(config, prefill),
        )
        self.auth = TenantAuth.from_config(config)  # API keys and tenants (tenants.py)
        self.gate = TenantGate.from_config(config, self.client)  # quotas (tenant_gate.py)
        self.limits = RequestLimits.from_config(config)
        parsing = OutputParsing.of(config.parsing, tokenizer)
        self.preparer = Preparer(self.prompts, self.client, self.limits, parsing)
        # What `model` names: the served model or a LoRA adapter (cluster/ingress/lora_catalog.py).
        # The config's adapters are read here: a bad one fails the deployment, naming it.
        check = AdapterCheck(config)
        check.check_static()
        self.lora = LoraCatalog.from_config(config, check=check)
        # Set through Serve's user_config when `kvray serve` begins to shut down: /ready is
        # 503 and new generation requests are refused while in-flight ones finish.
        self.draining = False
        logger.info(
            "OpenAIIngress ready: model=%s auth=%s tool calls=%s reasoning=%s",
            self.model,
            self.auth.enabled,
            parsing.tool_format,
            parsing.reasoning or "off",
        )

    def reconfigure(self, user_config: dict[str, Any]) -> None:
        """Serve's hook for the deployment's user_config ({"draining": bool})."""
        draining = bool(user_config.get("draining", False))
        if draining and not self.draining:
            logger.info("draining: /ready is 503, new requests are refused")
        self.draining = draining

    def __serve_build_asgi_app__(self) -> Any:
        # Auth and the body-size bound run before FastAPI reads the body (cluster/http/guard.py).
        guarded = RequestGuard(
            GatewayHint(build_api(self)),  # an inference gateway's pod choice (gateway_hint.py)
            self.auth,
            self.config.limits.max_request_body_bytes,
            self.metrics,
            max_in_flight=self.config.ingress_max_in_flight(),
        )
        return traced_app(StatusCounter(guarded, self.metrics), self.spans)

    # -- pieces the routes use ---------------------------------------------------------------

    def check_admitting(self) -> None:
        """A draining ingress refuses new generation requests before any work on them."""
        if self.draining:
            raise DrainingError()

    async def run(
        self,
        fmt: Formatter | ResponsesFormatter,
        prepared: Prepared,
        include_usage: bool,
        frames: Any = streams.sse_frames,
    ) -> Any:
        """Starts one engine request per prompt, answers with JSON or an SSE stream (as the
        SamplingParams' output kind says); `frames` writes the stream (chat's and
        completions' SSE chunks, or /v1/responses' events)."""
        await self.gate.admit(prepared)  # 429 over the tenant's quota
        self.metrics.checked("http", prepared.params)
        reqs = hinted(prepared.requests(fmt.id))  # the node a gateway chose, if any
        outs = [self.gate.metered(self.client.generate(r), r) for r in reqs]
        try:
            # The first output of every prompt before answering: errors (400/429/503) become
            # a status code, not a broken stream.
            firsts = await streams.first_of_each(outs)
        except BaseException:
            await streams.close_all(outs)
            raise
        if not checks.is_streamed(prepared.params):
            try:
                finals = [await streams.last(s, f) for s, f in zip(outs, firsts, strict=True)]
            finally:
                await streams.close_all(outs)
            return JSONResponse(fmt.response(finals))
        return StreamingResponse(
            frames(fmt, outs, firsts, include_usage),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache"},
        )


class ErrorDetail(BaseModel):
    """OpenAI's error object, for the OpenAPI schema (bodies come from KvrayError.to_openai)."""

    message: str
    type: str
    param: str | None
    code: int | str | None


class ErrorBody(BaseModel):
    error: ErrorDetail


# Every route's errors in the OpenAPI schema: OpenAI's body, never FastAPI's 422 (a body
# that fails validation is a 400 here), so clients and fuzzers built from the schema know them.
ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    "4XX": {"model": ErrorBody, "description": "A refused request, in OpenAI's error format"},
    "5XX": {"model": ErrorBody, "description": "A server-side failure, in OpenAI's error format"},
}
# The generation routes answer one JSON body, or SSE frames when the request sets stream=true.
GENERATION_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {
        "description": "The completion: JSON, or server-sent events with stream=true",
        "content": {
            "text/event-stream": {
                # One event (OpenAPI 3.1): `data` is a chunk as JSON, or [DONE] at the end.
                "schema": {
                    "type": "object",
                    "properties": {"data": {"type": "string"}},
                    "required": ["data"],
                }
            }
        },
    }
}

# The readiness probe's own refusal (draining, or no engine replica answered): not an error body.
READY_RESPONSES: dict[int | str, dict[str, Any]] = {
    503: {
        "description": "Not ready: draining, or no healthy engine replica answered",
        "content": {
            "application/json": {
                "schema": {
                    "type": "object",
                    "properties": {"status": {"type": "string"}, "reason": {"type": "string"}},
                    "required": ["status"],
                }
            }
        },
    }
}


def build_api(ingress: OpenAIIngress) -> FastAPI:
    """The FastAPI app of one ingress replica; routes close over `ingress`. The API key and
    body size are checked in front of it (RequestGuard)."""

    app = FastAPI(title="kvray", responses=ERROR_RESPONSES)

    # Errors leave in OpenAI's shape, or Anthropic's on its Messages routes.
    @app.exception_handler(KvrayError)
    async def _kvray_error(request: Request, err: KvrayError) -> JSONResponse:
        return error_response(err, ingress.metrics, is_messages_path(api_path(request.scope)))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, err: RequestValidationError) -> JSONResponse:
        anthropic = is_messages_path(api_path(request.scope))
        return error_response(validation_to_invalid(err), ingress.metrics, anthropic)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, err: StarletteHTTPException) -> JSONResponse:
        # Starlette's own errors (404 unknown route, 405 wrong method) in the API's format.
        status, body = err.status_code, http_error_body(err.status_code, str(err.detail))
        if is_messages_path(api_path(request.scope)):
            status, body = from_status(err.status_code, str(err.detail))
        return JSONResponse(body, status_code=status, headers=getattr(err, "headers", None))

    @app.get("/health")
    async def health() -> dict[str, str]:
        # RequestGuard answers GET /health itself, before any other work (the liveness probe
        # must stay fast under a burst); this route keeps it in the OpenAPI schema.
        return {"status": "ok"}

    @app.get("/ready", responses=READY_RESPONSES)
    async def ready() -> JSONResponse:
        if ingress.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        try:
            await asyncio.wait_for(ingress.llm.check_health.remote(), READY_TIMEOUT_S)
        except Exception as err:  # no healthy engine replica answered in time
            return JSONResponse({"status": "not ready", "reason": str(err)[:200]}, status_code=503)
        return JSONResponse({"status": "ready"})

    @app.post("/v1/completions", responses=GENERATION_RESPONSES)
    async def completions(body: CompletionRequest) -> Any:
        target = await ingress.lora.target(body.model)  # the model, or one of its adapters
        ingress.check_admitting()
        prepared = await ingress.preparer.prepare(body, lora=target.lora, tenant=current_tenant())
        fmt = Formatter(
            "completion",
            f"cmpl-{uuid.uuid4().hex}",
            target.name,
            body.n,
            body.logprobs,
            ingress.token_strings,
            echo=await prompt_echo(body, prepared, ingress.prompts),
            prompt_logprobs=body.answered_prompt_logprobs,
        )
        return await ingress.run(fmt, prepared, body.include_usage)

    @app.post("/v1/chat/completions", responses=GENERATION_RESPONSES)
    async def chat_completions(body: ChatCompletionRequest) -> Any:
        target = await ingress.lora.target(body.model)
        ingress.check_admitting()
        # The tools, the output constraint (response_format, structured_outputs, or the tool
        # calls') and the chat through the template, each read once.
        prepared = await ingress.preparer.prepare(body, lora=target.lora, tenant=current_tenant())
        top = (body.top_logprobs or 0) if body.logprobs else None
        fmt = Formatter(
            "chat",
            f"chatcmpl-{uuid.uuid4().hex}",
            target.name,
            body.n,
            top,
            ingress.token_strings,
            tools=prepared.tool_use,
            prompt_logprobs=body.answered_prompt_logprobs,
            reasoning=prepared.outputs.reasoning,  # None: no reasoning parser
        )
        return await ingress.run(fmt, prepared, body.include_usage)

    add_token_routes(app, ingress)  # /tokenize, /detokenize (cluster/http/token_routes.py)
    add_lora_routes(app, ingress)  # /v1/models, LoRA loading (cluster/http/lora_routes.py)
    add_responses_route(app, ingress)  # POST /v1/responses (cluster/http/responses_route.py)
    add_embeddings_route(app, ingress)  # POST /v1/embeddings (cluster/http/embeddings.py)
    add_messages_routes(app, ingress)  # Anthropic's /v1/messages (cluster/http/messages_route.py)
    return app


# -- errors -----------------------------------------------------------------------------------


def error_response(err: KvrayError, metrics: Any, anthropic: bool = False) -> JSONResponse:
    """`err` as the answer: OpenAI's body, or Anthropic's (`anthropic`: a Messages route)."""
    if isinstance(err, QueueFullError):
        metrics.rejected("queue_full")
    elif isinstance(err, QueueTimeoutError):
        metrics.rejected("queue_timeout")
    elif err.http_status == 401:
        metrics.rejected("unauthenticated")
    if anthropic:
        return messages_error(err)
    return JSONResponse(err.to_openai(), status_code=err.http_status, headers=err.http_headers())


def http_error_body(status: int, message: str) -> dict[str, Any]:
    """OpenAI's error body for an HTTP error that is not a KvrayError (404, 405, ...)."""
    kind = {404: "not_found_error", 405: "invalid_request_error"}.get(status)
    if kind is None:
        kind = "invalid_request_error" if 400 <= status < 500 else "internal_error"
    return {"error": {"message": message, "type": kind, "param": None, "code": status}}


def validation_to_invalid(err: RequestValidationError) -> InvalidRequestError:
    """A pydantic error -> 400 naming the field (dotted path below the body)."""
    errors = err.errors()
    if not errors:
        return InvalidRequestError(None, "invalid request body")
    first = errors[0]
    if first.get("type") == "json_invalid":  # loc is ("body", offset): no field to name
        return InvalidRequestError(None, f"the body is not valid JSON: {first.get('msg', '')}")
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

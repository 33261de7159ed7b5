"""Anthropic's Messages API routes, added to the ingress's app: POST /v1/messages and POST
/v1/messages/count_tokens.

A message is prepared by the same `Preparer` as a chat request and answered by the same
`OpenAIIngress.run` (admission, tenants, limits, routing, migration, metrics, client
disconnects), with the Messages formatter and its stream events instead of chat's. Errors on
these paths leave in Anthropic's shape (cluster/http/messages_errors.py): the app's error
handlers and the guard ask `messages_errors.is_messages_path`. The API key may come as
`x-api-key` (cluster/ingress/auth.py); `anthropic-version` and `anthropic-beta` headers are
accepted and not read.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse
from pydantic import BaseModel

from cluster.errors import KvrayError
from cluster.http import messages
from cluster.http.messages import CountTokensRequest, MessagesRequest
from cluster.http.messages_errors import from_error
from cluster.http.messages_format import MessagesFormatter, sse_events
from cluster.http.responses_route import Ingress  # what a route uses of OpenAIIngress
from cluster.ingress.tenants import current_tenant


class AnthropicErrorDetail(BaseModel):
    """Anthropic's error object, for the OpenAPI schema (bodies come from messages_errors)."""

    type: str
    message: str


class AnthropicError(BaseModel):
    type: str  # always "error"
    error: AnthropicErrorDetail


# These routes' errors in the OpenAPI schema: Anthropic's body, not OpenAI's.
ERRORS_DOC: dict[int | str, dict[str, Any]] = {
    "4XX": {"model": AnthropicError, "description": "A refused request, in Anthropic's format"},
    "5XX": {"model": AnthropicError, "description": "A failure, in Anthropic's format (529)"},
}
# The OpenAPI description of a 200: a Message, or typed SSE events with stream=true.
MESSAGES_DOC: dict[int | str, dict[str, Any]] = {
    **ERRORS_DOC,
    200: {
        "description": "The Message: JSON, or server-sent events with stream=true",
        "content": {
            "text/event-stream": {
                # One event: `event` is its type, `data` the event as JSON (with "type").
                "schema": {
                    "type": "object",
                    "properties": {"event": {"type": "string"}, "data": {"type": "string"}},
                    "required": ["event", "data"],
                }
            }
        },
    },
}


def error_response(err: KvrayError) -> JSONResponse:
    """`err` in Anthropic's shape and status, with the headers its class sets (Retry-After)."""
    status, body = from_error(err)
    return JSONResponse(body, status_code=status, headers=err.http_headers())


def add_messages_routes(app: FastAPI, ingress: Ingress) -> None:
    """Adds POST /v1/messages and /v1/messages/count_tokens to `app`."""

    @app.post("/v1/messages", responses=MESSAGES_DOC)
    async def create_message(body: MessagesRequest) -> Any:
        target = await ingress.lora.target(body.model)  # the model, or one of its adapters
        ingress.check_admitting()
        prepared = await messages.prepare(
            ingress.preparer, body, lora=target.lora, tenant=current_tenant()
        )
        prompt_tokens = len(prepared.inputs[0].prompt_token_ids)
        fmt = MessagesFormatter(
            target.name, prepared.tool_use, prompt_tokens, prepared.outputs.reasoning
        )
        return await ingress.run(fmt, prepared, False, frames=sse_events)

    @app.post("/v1/messages/count_tokens", responses=ERRORS_DOC)
    async def count_tokens(body: CountTokensRequest) -> dict[str, int]:
        await ingress.lora.target(body.model)  # an adapter's prompt is its model's
        return {"input_tokens": await messages.count_tokens(ingress.preparer, body)}

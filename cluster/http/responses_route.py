"""The POST /v1/responses route (OpenAI's Responses API, stateless), added to the ingress's app.

The request is prepared by the same `Preparer` as a chat request and answered by the same
`OpenAIIngress.run` (admission, limits, routing, metrics, client disconnects), with the
Responses formatter and its stream events instead of chat's.
"""

from __future__ import annotations

from typing import Any, Protocol

from fastapi import FastAPI

from cluster.http import responses
from cluster.http.responses import ResponsesRequest
from cluster.http.responses_format import ResponsesFormatter, sse_events
from cluster.ingress.lora_catalog import LoraCatalog
from cluster.ingress.prepare import Prepared, Preparer
from cluster.ingress.tenants import current_tenant


class Ingress(Protocol):
    """What the route uses of cluster.http.ingress.OpenAIIngress (which imports this module)."""

    preparer: Preparer
    lora: LoraCatalog  # what `model` names (cluster/ingress/lora_catalog.py)

    def check_admitting(self) -> None: ...

    async def run(
        self, fmt: Any, prepared: Prepared, include_usage: bool, frames: Any = ...
    ) -> Any: ...


# The OpenAPI description of a 200: a Response object, or typed SSE events with stream=true.
RESPONSES_DOC: dict[int | str, dict[str, Any]] = {
    200: {
        "description": "The Response object: JSON, or server-sent events with stream=true",
        "content": {
            "text/event-stream": {
                # One event: `event` is its type, `data` the event as JSON (with "type").
                "schema": {
                    "type": "object",
                    "properties": {"event": {"type": "string"}, "data": {"type": "string"}},
                    "required": ["data"],
                }
            }
        },
    }
}


def add_responses_route(app: FastAPI, ingress: Ingress) -> None:
    """Adds POST /v1/responses to `app`; the route closes over `ingress`."""

    @app.post("/v1/responses", responses=RESPONSES_DOC)
    async def create_response(body: ResponsesRequest) -> Any:
        target = await ingress.lora.target(body.model)  # the model, or one of its adapters
        ingress.check_admitting()
        prepared = await responses.prepare(
            ingress.preparer, body, lora=target.lora, tenant=current_tenant()
        )
        fmt = ResponsesFormatter(
            body.echo(prepared.tool_use),
            target.name,
            prepared.tool_use,
            prepared.outputs.reasoning,  # None: no reasoning parser
        )
        return await ingress.run(fmt, prepared, False, frames=sse_events)

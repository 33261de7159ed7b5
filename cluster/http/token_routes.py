"""POST /tokenize and /detokenize (vLLM's), added to the HTTP ingress's app: a prompt or a
chat as the served model's token ids (the chat through its template, tools listed and
`chat_template_kwargs` passed to it, as for a chat request), and ids back to text. An
adapter's name tokenizes as its model."""

from __future__ import annotations

from typing import Any, Protocol

from fastapi import FastAPI

from cluster.errors import InvalidRequestError
from cluster.http.protocol import DetokenizeRequest, TokenizeRequest, template_kwargs
from cluster.ingress.limits import RequestLimits
from cluster.ingress.llm_client import LLMClient
from cluster.ingress.lora_catalog import LoraCatalog
from cluster.ingress.prompts import Prompts


class Ingress(Protocol):
    """What the routes use of cluster.http.ingress.OpenAIIngress (which imports this module)."""

    client: LLMClient
    lora: LoraCatalog
    limits: RequestLimits
    prompts: Prompts


def add_token_routes(app: FastAPI, ingress: Ingress) -> None:
    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        await ingress.lora.target(body.model)  # an adapter tokenizes as its model
        if body.messages is not None:
            ingress.limits.check_messages(len(body.messages))
            ids = await ingress.prompts.chat(
                [m.as_template_input() for m in body.messages],
                body.add_generation_prompt,
                tools=body.template_tools(),
                template_kwargs=template_kwargs(body.chat_template_kwargs),
            )
        elif body.prompt is not None:
            ids = await ingress.prompts.text(body.prompt, allow_empty=True)
        else:
            raise InvalidRequestError("prompt", "send prompt or messages")
        card = await ingress.client.model_card()
        return {"tokens": ids, "count": len(ids), "max_model_len": card["max_model_len"]}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict[str, Any]:
        await ingress.lora.target(body.model)
        ids = ingress.prompts.token_ids(body.tokens, "tokens")
        return {"prompt": await ingress.prompts.decode(ids)}

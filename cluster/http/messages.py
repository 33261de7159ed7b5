"""POST /v1/messages: Anthropic's Messages API request, read the way a chat request is.

A `MessagesRequest` is a `cluster.ingress.prepare.Source`, like a chat body: `system` and
`messages` become the chat template's messages, `tools` and `tool_choice` chat's `ToolUse`
(cluster/http/messages_input.py), and `max_tokens`, `stop_sequences`, `temperature`,
`top_p` and `top_k` the SamplingParams. The shared `Preparer` then checks it into the
engine's inputs exactly as it does a chat request, and the ingress routes it the same way
(admission, tenants, limits, routing, migration, metrics).

`max_tokens` is required (as Anthropic's API has it). `metadata` is accepted (`user_id` is
not used). `thinking` switches a reasoning model's thinking on or off through the chat
template's `enable_thinking` variable (messages_input.thinking_kwargs; `budget_tokens` is
accepted and not enforced); with a reasoning parser on, the thinking comes back as a
`thinking` block. Fields kvray does not act on (`service_tier`, `container`, ...) are
ignored, as chat ignores unknown fields: agents send them routinely.
`CountTokensRequest` is the same body without `max_tokens`, for /v1/messages/count_tokens.
"""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict

from cluster.errors import InvalidRequestError
from cluster.http import messages_input
from cluster.http.protocol import Bool, Float, Int
from cluster.ingress.limits import RequestLimits
from cluster.ingress.prepare import Prepared, Preparer, PromptInput
from cluster.ingress.structured import Constraint
from cluster.ingress.tools import ToolUse
from workers.lora.request import LoRARequest


class CountTokensRequest(BaseModel):
    """The body of POST /v1/messages/count_tokens: what the prompt is made of."""

    model_config = ConfigDict(extra="ignore")
    # Where the request holds its tools (what the tool calls' constraint names).
    tools_field: ClassVar[str] = "tools"

    model: str | None = None
    system: str | list[Any] | None = None
    messages: list[Any]
    tools: list[Any] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: Any = None  # checked by messages_input.thinking_kwargs, errors in its words

    def prompt_input(self, limits: RequestLimits) -> PromptInput:
        chat = messages_input.template_messages(self.system, self.messages)
        limits.check_messages(len(self.messages))
        kwargs = messages_input.thinking_kwargs(self.thinking)
        # budget_tokens is enforced where a reasoning parser is on, and ignored elsewhere
        # (budget_field None): clients such as Claude Code send it whatever the server.
        return PromptInput(
            "messages",
            chat=chat,
            checked_as="messages",
            template_kwargs=kwargs,
            thinking_budget=messages_input.thinking_budget(self.thinking),
        )

    def tool_use(self) -> ToolUse | None:
        return messages_input.tool_use(self.tools, self.tool_choice)


class MessagesRequest(CountTokensRequest):
    """The body of POST /v1/messages."""

    max_tokens: Int
    stop_sequences: list[str] | None = None
    temperature: Float | None = None
    top_p: Float | None = None
    top_k: Int | None = None
    stream: Bool = False
    metadata: dict[str, Any] | None = None  # accepted; user_id is not used
    priority: Int = 0  # vLLM's extra: the engine's queue priority, lower is more urgent

    # -- cluster.ingress.prepare.Source ---------------------------------------------------

    def sampling_kwargs(self) -> dict[str, Any]:
        if self.max_tokens < 1:
            raise InvalidRequestError("max_tokens", "max_tokens: must be at least 1")
        params: dict[str, Any] = {"n": 1, "max_tokens": self.max_tokens}
        if self.stop_sequences:
            params["stop"] = list(self.stop_sequences)
        for name in ("temperature", "top_p", "top_k"):
            value = getattr(self, name)
            if value is not None:
                params[name] = value
        return params

    def parameters_field(self, index: int) -> str:
        return f"tools.{index}.input_schema"

    def own_constraint(self) -> Constraint | None:
        return None  # Anthropic's API has no output constraint of its own here


async def prepare(
    preparer: Preparer,
    body: MessagesRequest,
    *,
    lora: LoRARequest | None = None,
    tenant: str | None = None,
) -> Prepared:
    """The request checked into the engine's inputs by the shared preparation; an error
    names the field as a Messages request spells it."""
    try:
        return await preparer.prepare(body, lora=lora, tenant=tenant)
    except InvalidRequestError as err:
        raise renamed(err) from None


async def count_tokens(preparer: Preparer, body: CountTokensRequest) -> int:
    """The templated prompt's token count, as `prepare` builds the prompt (tools listed)."""
    try:
        prompt = body.prompt_input(preparer.limits)
        (ids,) = await preparer.token_ids(prompt, body.tool_use())
    except InvalidRequestError as err:
        raise renamed(err) from None
    return len(ids)


def renamed(err: InvalidRequestError) -> InvalidRequestError:
    """The engine's checks name chat's fields: `stop` is `stop_sequences` here, and a tool's
    `parameters` its `input_schema`."""
    if err.param == "stop":
        return InvalidRequestError(
            "stop_sequences", err.message.replace("stop", "stop_sequences", 1)
        )
    return messages_input.renamed_schema(err)

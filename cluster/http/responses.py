"""POST /v1/responses: OpenAI's Responses API request, read the way a chat request is.

A `ResponsesRequest` is a `cluster.ingress.prepare.Source`, like a chat body: its `input` and
`instructions` become the chat template's messages, its flat function tools and tool_choice
become chat's `ToolUse`, `text.format` the output constraint, and `max_output_tokens`,
`temperature`, `top_p` and `seed` the SamplingParams (cluster/http/responses_input.py), and
`chat_template_kwargs` (vLLM's, as on chat: e.g. `{"enable_thinking": false}`) the template's
variables. The shared `Preparer` then checks it into the engine's inputs exactly as it does a
chat request, and the ingress routes it the same way (admission, limits, routing, metrics).

kvray is stateless: it stores no responses. `store` is accepted (and nothing is stored);
what needs stored state (`previous_response_id`, `conversation`, `background`) is a 400, and
so is every other field kvray does not act on — built-in tools, `reasoning`, `include`,
`truncation` other than "disabled", unknown fields — each naming the field: dropping it
silently would answer a different request than the one sent.
"""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field

from cluster.errors import InvalidRequestError
from cluster.http import responses_input
from cluster.http.protocol import Bool, Float, Int, template_kwargs
from cluster.ingress.limits import RequestLimits
from cluster.ingress.prepare import Prepared, Preparer, PromptInput
from cluster.ingress.structured import Constraint
from cluster.ingress.tools import ToolUse
from workers.lora.request import LoRARequest

STATELESS = "kvray stores no responses (a stateless server): send the whole conversation in input"
# Fields kvray accepts only at the value that asks for nothing (None: unset), and why any
# other value is refused.
NEUTRAL: dict[str, tuple[tuple[Any, ...], str]] = {
    "background": ((None, False), STATELESS),
    "conversation": ((None,), STATELESS),
    "prompt": ((None,), "stored prompt templates need stored state; " + STATELESS),
    "reasoning": ((None,), "reasoning options are not supported"),
    "include": ((None, []), "kvray returns no additional output data"),
    "truncation": (
        (None, "disabled"),
        "only 'disabled' is supported: an input too long for the context is a 400",
    ),
    "top_logprobs": ((None, 0), "logprobs are not returned by /v1/responses"),
    "max_tool_calls": ((None,), "kvray serves no built-in tools"),
    "service_tier": ((None, "auto", "default"), "kvray has one service tier"),
    "stream_options": ((None,), "stream options are not supported"),
}
METADATA_PAIRS, METADATA_KEY_CHARS, METADATA_VALUE_CHARS = 16, 64, 512


class ResponsesRequest(BaseModel):
    """The body of POST /v1/responses. Fields it does not declare are kept (`model_extra`)
    so that `check_fields` can refuse them by name instead of ignoring them."""

    model_config = ConfigDict(extra="allow")
    # Where the request holds its tools (what the tool calls' constraint names).
    tools_field: ClassVar[str] = "tools"

    model: str | None = None
    input: str | list[Any]
    instructions: str | None = None
    max_output_tokens: Int | None = None
    temperature: Float | None = None
    top_p: Float | None = None
    seed: Int | None = None
    stream: Bool | None = None
    text: dict[str, Any] | None = None
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: Bool | None = None
    metadata: dict[str, str] | None = None
    store: Bool | None = None  # accepted; nothing is stored
    previous_response_id: str | None = None  # refused: kvray stores no responses
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None  # prefix caching needs no key
    priority: Int = 0  # vLLM's: the engine's queue priority, lower is more urgent
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's: the template's variables
    # As on chat: tokens of thinking before `</think>` is forced (needs a reasoning parser).
    thinking_token_budget: Int | None = Field(default=None, ge=0)

    def check_fields(self) -> None:
        """400 naming the first field kvray does not act on (module doc)."""
        if self.previous_response_id is not None:
            raise InvalidRequestError(
                "previous_response_id", f"previous_response_id is not supported: {STATELESS}"
            )
        for name, value in (self.model_extra or {}).items():
            allowed, reason = NEUTRAL.get(name, ((), "not a field kvray's /v1/responses takes"))
            if not any(value == a and type(value) is type(a) for a in allowed):
                raise InvalidRequestError(name, f"{name} is not supported: {reason}")
        meta = self.metadata or {}
        if len(meta) > METADATA_PAIRS:
            raise InvalidRequestError(
                "metadata", f"metadata has {len(meta)} pairs; at most {METADATA_PAIRS} are allowed"
            )
        for key, value in meta.items():
            if len(key) > METADATA_KEY_CHARS or len(value) > METADATA_VALUE_CHARS:
                raise InvalidRequestError(
                    "metadata",
                    f"metadata keys are at most {METADATA_KEY_CHARS} characters and values "
                    f"at most {METADATA_VALUE_CHARS}",
                )

    # -- cluster.ingress.prepare.Source ---------------------------------------------------

    def prompt_input(self, limits: RequestLimits) -> PromptInput:
        messages = responses_input.input_messages(self.input, self.instructions)
        limits.check_messages(len(messages), "input")
        return PromptInput(
            "input",
            chat=messages,
            checked_as="input",
            template_kwargs=template_kwargs(self.chat_template_kwargs),
            thinking_budget=self.thinking_token_budget,
            budget_field="thinking_token_budget",
        )

    def sampling_kwargs(self) -> dict[str, Any]:
        # max_tokens None: the rest of the context, as for chat.
        params: dict[str, Any] = {"n": 1, "max_tokens": self.max_output_tokens, "seed": self.seed}
        if self.temperature is not None:
            params["temperature"] = self.temperature
        if self.top_p is not None:
            params["top_p"] = self.top_p
        return params

    def tool_use(self) -> ToolUse | None:
        return responses_input.tool_use(self.tools, self.tool_choice, self.parallel_tool_calls)

    def parameters_field(self, index: int) -> str:
        return f"tools[{index}].parameters"

    def own_constraint(self) -> Constraint | None:
        return responses_input.text_constraint(responses_input.text_format(self.text))

    # -- what the response object echoes ------------------------------------------------------

    def echo(self, use: ToolUse | None) -> dict[str, Any]:
        """The request's settings as the Response object repeats them (checked values)."""
        strict = [t.get("strict") if isinstance(t, dict) else None for t in self.tools or ()]
        tools = [
            responses_input.as_response_tool(tool, flag)
            for tool, flag in zip(use.tools if use else (), strict, strict=False)
        ]
        return {
            "instructions": self.instructions,
            "max_output_tokens": self.max_output_tokens,
            "temperature": 1.0 if self.temperature is None else self.temperature,
            "top_p": 1.0 if self.top_p is None else self.top_p,
            "tools": tools,
            "tool_choice": _choice(use, self.tool_choice),
            "parallel_tool_calls": self.parallel_tool_calls is not False,
            "text": {"format": responses_input.text_format(self.text)},
            "metadata": self.metadata or {},
            "previous_response_id": None,
            "reasoning": None,
            "truncation": "disabled",
            "background": False,
            "user": self.user,
            "safety_identifier": self.safety_identifier,
            "prompt_cache_key": self.prompt_cache_key,
        }


def _choice(use: ToolUse | None, asked: Any) -> Any:
    if use is None:
        return asked if isinstance(asked, str) else "auto"
    if use.choice.mode == "named":
        return {"type": "function", "name": use.choice.name}
    return use.choice.mode


async def prepare(
    preparer: Preparer,
    body: ResponsesRequest,
    *,
    lora: LoRARequest | None = None,
    tenant: str | None = None,
) -> Prepared:
    """The request checked into the engine's inputs by the shared preparation (under the
    adapter `lora`, for `tenant`); an error names the field as a Responses request spells it."""
    body.check_fields()
    try:
        return await preparer.prepare(body, lora=lora, tenant=tenant)
    except InvalidRequestError as err:
        raise renamed(err) from None


def renamed(err: InvalidRequestError) -> InvalidRequestError:
    """The engine's checks name max_tokens: a Responses request calls it max_output_tokens."""
    if err.param != "max_tokens":
        return err
    return InvalidRequestError(
        "max_output_tokens", err.message.replace("max_tokens", "max_output_tokens")
    )

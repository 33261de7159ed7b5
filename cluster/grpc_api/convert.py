"""kvray.v1 requests -> the engine's SamplingParams and inputs (RequestOutputs -> responses:
answer.py, re-exported here).

Pure functions, no Ray and no server: the gRPC ingress (cluster/grpc_api/servicer.py) is these
plus transport and the shared ingress preparation (cluster/ingress/prepare.py), which reads a
GenerateRequest through `GenerateSource`. Sampling options get the same
defaults as the HTTP API (max_tokens 16 for text and token-id prompts as /v1/completions, unset
for chat as /v1/chat/completions), so both APIs give the same output for the same request.
Field values are checked by the engine's SamplingParams, once for both APIs; errors name the
field as the client wrote it (`sampling.top_p`). A chat's `chat_template_kwargs_json` and
`thinking_token_budget` are read into the PromptInput as the HTTP API's chat_template_kwargs and
thinking_token_budget are.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from cluster.errors import InvalidRequestError
from cluster.grpc_api import constraints

# The response side lives in answer.py; its names stay importable from here (servicer, tests).
from cluster.grpc_api.answer import ResponseContext as ResponseContext
from cluster.grpc_api.answer import StreamState as StreamState
from cluster.grpc_api.answer import TokenText as TokenText
from cluster.grpc_api.answer import add_prompt_logprobs as add_prompt_logprobs
from cluster.grpc_api.answer import final_response as final_response
from cluster.grpc_api.answer import stream_response as stream_response
from cluster.grpc_api.answer import token_logprob as token_logprob
from cluster.grpc_api.answer import usage as usage
from cluster.ingress import embeddings, prepare
from cluster.ingress.embeddings import EmbedInput, EmbedOptions
from cluster.ingress.limits import DEFAULT_LIMITS, RequestLimits
from cluster.ingress.prepare import PromptInput
from kvray.v1 import llm_pb2
from workers.sampling_params import DEFAULT_MAX_TOKENS, SamplingParams

if TYPE_CHECKING:
    from cluster.ingress.structured import Constraint
    from cluster.ingress.tools import ToolUse
    from workers.outputs import RequestOutput

# /v1/completions' default; chat leaves max_tokens unset (up to the context length).
CHAT_ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})

# SamplingParams message fields that are proto3 `optional` (unset = the engine's default);
# the output constraint's oneof members are converted on their own (constraints.py).
_CONSTRAINT_FIELDS = frozenset(
    f.name for f in llm_pb2.SamplingParams.DESCRIPTOR.oneofs_by_name["structured_outputs"].fields
)
_OPTIONAL_FIELDS = tuple(
    f.name
    for f in llm_pb2.SamplingParams.DESCRIPTOR.fields
    if f.has_presence and f.name not in _CONSTRAINT_FIELDS
)
# Ingress / SamplingParams field names -> where the field is in a GenerateRequest.
_REQUEST_FIELD_PATHS = {
    "messages": "chat",
    "chat_template_kwargs": "chat.chat_template_kwargs_json",  # the template's reserved names
    "logprobs": "logprobs.top_logprobs",
    **{f.name: f"sampling.{f.name}" for f in llm_pb2.SamplingParams.DESCRIPTOR.fields},
}
_TEMPLATE_KWARGS_FIELD = "chat.chat_template_kwargs_json"
_BUDGET_FIELD = "chat.thinking_token_budget"
# EmbedRequest.pooling_type -> workers.pooling's kind (None: the default, last).
_POOLING_TYPES = {
    llm_pb2.POOLING_TYPE_UNSPECIFIED: None,
    llm_pb2.POOLING_TYPE_LAST: "last",
    llm_pb2.POOLING_TYPE_MEAN: "mean",
}


def input_kind(req: llm_pb2.GenerateRequest | llm_pb2.TokenizeRequest) -> str | None:
    """Which member of the `input` oneof is set ("text", "token_ids", "chat"), or None."""
    return req.WhichOneof("input")


def prompt_input(
    req: llm_pb2.GenerateRequest | llm_pb2.TokenizeRequest,
    limits: RequestLimits = DEFAULT_LIMITS,
) -> tuple[str, str | list[int] | list[dict[str, str]]]:
    """The `input` oneof as (kind, value): text, token ids, or chat messages as dicts."""
    kind = input_kind(req)
    if kind == "text":
        if not req.text:
            raise InvalidRequestError("text", "text must not be empty")
        return kind, req.text
    if kind == "token_ids":
        if not req.token_ids.ids:
            raise InvalidRequestError("token_ids", "token_ids.ids must hold at least one token id")
        return kind, list(req.token_ids.ids)
    if kind == "chat":
        return kind, chat_messages(req.chat, limits)
    raise InvalidRequestError("input", "set one of the input fields (text, token_ids, chat)")


def prompt_of(
    req: llm_pb2.GenerateRequest | llm_pb2.TokenizeRequest,
    limits: RequestLimits = DEFAULT_LIMITS,
) -> PromptInput:
    """The `input` oneof, checked, as the shared preparation takes it. Errors of the engine's
    input check name "prompt", which `request_field_path` places at the member set."""
    kind, value = prompt_input(req, limits)
    if kind == "chat":
        chat = req.chat
        budget = chat.thinking_token_budget if chat.HasField("thinking_token_budget") else None
        return PromptInput(
            "chat",
            chat=value,  # type: ignore[arg-type]
            template_kwargs=template_kwargs(chat),
            # Without a reasoning parser the Preparer refuses a budget, naming this field.
            thinking_budget=budget,
            budget_field=_BUDGET_FIELD,
        )
    return PromptInput(kind, batch=(value,))  # type: ignore[arg-type]


class GenerateSource:
    """A GenerateRequest as the shared preparation reads it (cluster.ingress.prepare.Source)."""

    tools_field = "chat.tools"

    def __init__(self, req: llm_pb2.GenerateRequest, *, stream: bool) -> None:
        self.req = req
        self.stream = stream
        self.chat = input_kind(req) == "chat"

    def parameters_field(self, index: int) -> str:
        return f"chat.tools[{index}].parameters_json"

    @property
    def priority(self) -> int:
        return self.req.priority

    def prompt_input(self, limits: RequestLimits) -> PromptInput:
        return prompt_of(self.req, limits)

    def sampling_kwargs(self) -> dict[str, Any]:
        return sampling_kwargs(self.req, chat=self.chat)

    def tool_use(self) -> ToolUse | None:
        return constraints.tool_use(self.req.chat) if self.chat else None

    def own_constraint(self) -> Constraint | None:
        return constraints.sampling_constraint(self.req.sampling)


def sampling_params(
    req: llm_pb2.GenerateRequest, *, stream: bool, limits: RequestLimits = DEFAULT_LIMITS
) -> SamplingParams:
    """The engine's SamplingParams for a request (validated, within `limits`; output kind as
    `stream` needs; the output constraint, the sampling oneof's or the tool calls')."""
    return prepare.sampling_params(GenerateSource(req, stream=stream), limits)


def chat_messages(
    chat: llm_pb2.ChatMessages, limits: RequestLimits = DEFAULT_LIMITS
) -> list[dict[str, str]]:
    if not chat.messages:
        raise InvalidRequestError("chat.messages", "chat.messages must hold at least one message")
    limits.check_messages(len(chat.messages), "chat.messages")
    for i, m in enumerate(chat.messages):
        if m.role not in CHAT_ROLES:
            raise InvalidRequestError(
                f"chat.messages[{i}].role",
                f"chat.messages[{i}].role must be one of {', '.join(sorted(CHAT_ROLES))}, "
                f"got {m.role!r}",
            )
    return [constraints.template_message(m) for m in chat.messages]


def template_kwargs(chat: llm_pb2.ChatMessages) -> dict[str, Any] | None:
    """ChatMessages.chat_template_kwargs_json: a JSON object (None: empty). JSON object keys
    are strings, so an object is all the HTTP API's check (string keys) asks of it."""
    text = chat.chat_template_kwargs_json
    if not text:
        return None
    try:
        value = json.loads(text)
    except (ValueError, RecursionError) as err:
        raise InvalidRequestError(
            _TEMPLATE_KWARGS_FIELD, f"{_TEMPLATE_KWARGS_FIELD} is not valid JSON: {err}"
        ) from None
    if not isinstance(value, dict):
        raise InvalidRequestError(
            _TEMPLATE_KWARGS_FIELD,
            f"{_TEMPLATE_KWARGS_FIELD} must be a JSON object with string keys, "
            f"got {type(value).__name__}",
        )
    return value


def sampling_kwargs(req: llm_pb2.GenerateRequest, *, chat: bool) -> dict[str, Any]:
    """SamplingParams keyword arguments: the fields the client set, HTTP API defaults else;
    the output constraint aside (GenerateSource)."""
    sp = req.sampling
    params: dict[str, Any] = {
        name: getattr(sp, name) for name in _OPTIONAL_FIELDS if sp.HasField(name)
    }
    params.setdefault("max_tokens", None if chat else DEFAULT_MAX_TOKENS)
    if sp.stop:
        params["stop"] = list(sp.stop)
    if sp.stop_token_ids:
        params["stop_token_ids"] = list(sp.stop_token_ids)
    if sp.ignore_eos:
        params["ignore_eos"] = True
    if sp.include_stop_str_in_output:
        params["include_stop_str_in_output"] = True
    if req.HasField("logprobs"):
        params["logprobs"] = req.logprobs.top_logprobs
    if req.HasField("prompt_logprobs"):
        params["prompt_logprobs"] = req.prompt_logprobs
    return params


def request_field_path(field_name: str | None, kind: str | None) -> str | None:
    """Where an error's field (a SamplingParams name, or "prompt" for the input) lives in the
    GenerateRequest the client sent."""
    if field_name is None:
        return None
    if field_name == "prompt":
        return kind or "input"
    return _REQUEST_FIELD_PATHS.get(field_name, field_name)


def embed_inputs(req: llm_pb2.EmbedRequest) -> list[EmbedInput]:
    """The inputs of an EmbedRequest; errors name each as `inputs[i].text` / `.token_ids`."""
    inputs = []
    for i, inp in enumerate(req.inputs):
        kind = inp.WhichOneof("input")
        if kind is None:
            raise InvalidRequestError(f"inputs[{i}]", f"inputs[{i}] must set text or token_ids")
        path = f"inputs[{i}].{kind}"
        value = inp.text if kind == "text" else list(inp.token_ids.ids)
        inputs.append(EmbedInput(value, path, path))
    return inputs


def embed_options(req: llm_pb2.EmbedRequest) -> EmbedOptions:
    """Pooling, normalization and truncation of an EmbedRequest (unset: the HTTP defaults)."""
    if req.pooling_type not in _POOLING_TYPES:
        raise InvalidRequestError(
            "pooling_type", f"pooling_type {req.pooling_type} is not a PoolingType value"
        )
    normalize = req.normalize if req.HasField("normalize") else None
    truncate = req.truncate_prompt_tokens if req.HasField("truncate_prompt_tokens") else None
    return EmbedOptions(embeddings.pooling(_POOLING_TYPES[req.pooling_type], normalize), truncate)


def embed_response(
    finals: list[RequestOutput], request_id: str, model: str
) -> llm_pb2.EmbedResponse:
    """The Embed answer from each input's final output, in input order."""
    resp = llm_pb2.EmbedResponse(request_id=request_id, model=model)
    for i, out in enumerate(finals):
        resp.embeddings.add(index=i, values=embeddings.embedding_of(out, i))
    tokens = sum(embeddings.prompt_tokens(out) for out in finals)
    resp.usage.prompt_tokens = tokens
    resp.usage.total_tokens = tokens
    return resp

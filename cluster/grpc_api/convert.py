"""kvray.v1 messages <-> the engine's SamplingParams and RequestOutputs.

Pure functions, no Ray and no server: the gRPC ingress (cluster/grpc_api/servicer.py) is these
plus transport and the shared ingress preparation (cluster/ingress/prepare.py), which reads a
GenerateRequest through `GenerateSource`. Sampling options get the same
defaults as the HTTP API (max_tokens 16 for text and token-id prompts as /v1/completions, unset
for chat as /v1/chat/completions), so both APIs give the same output for the same request.
Field values are checked by the engine's SamplingParams, once for both APIs; errors name the
field as the client wrote it (`sampling.top_p`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from cluster.errors import InvalidRequestError
from cluster.grpc_api import constraints
from cluster.ingress import embeddings, prepare
from cluster.ingress.embeddings import EmbedInput, EmbedOptions
from cluster.ingress.limits import DEFAULT_LIMITS, RequestLimits
from cluster.ingress.prepare import PromptInput
from cluster.ingress.tool_calls import ToolCall, ToolCallParser, finish_reason
from kvray.v1 import llm_pb2
from workers.sampling_params import DEFAULT_MAX_TOKENS, SamplingParams

if TYPE_CHECKING:
    from cluster.ingress.structured import Constraint
    from cluster.ingress.tools import ToolUse
    from workers.outputs import CompletionOutput, RequestOutput, TokenLogprobs

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
_FINISH_REASONS = {
    "stop": llm_pb2.FINISH_REASON_STOP,
    "length": llm_pb2.FINISH_REASON_LENGTH,
    "abort": llm_pb2.FINISH_REASON_ABORT,
    "tool_calls": llm_pb2.FINISH_REASON_TOOL_CALLS,
}
# Ingress / SamplingParams field names -> where the field is in a GenerateRequest.
_REQUEST_FIELD_PATHS = {
    "messages": "chat",
    "logprobs": "logprobs.top_logprobs",
    **{f.name: f"sampling.{f.name}" for f in llm_pb2.SamplingParams.DESCRIPTOR.fields},
}

TokenText = Callable[[int], str]
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
        return PromptInput("chat", chat=value)  # type: ignore[arg-type]
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


@dataclass(frozen=True)
class ResponseContext:
    """Per-request constants of the responses: ids, and how to render logprobs."""

    request_id: str
    model: str
    top_logprobs: int = 0  # alternatives per position (the request's LogprobsOptions)
    token_text: TokenText | None = None  # token id -> its text; None leaves `token` empty
    tools: ToolUse | None = None  # chat tools: the output is read for calls when they parse
    # GenerateRequest.prompt_logprobs (alternatives per prompt position; None: not asked) and
    # the prompt they score (a streamed output does not repeat it).
    prompt_logprobs: int | None = None
    prompt_token_ids: tuple[int, ...] = ()

    def tool_parser(self) -> ToolCallParser | None:
        if self.tools is None or not self.tools.parses:
            return None
        return self.tools.parser()


@dataclass
class StreamState:
    """What a GenerateStream has already told the client (finish is sent once per sample)."""

    finished: set[int] = field(default_factory=set)
    parsers: dict[int, ToolCallParser | None] = field(default_factory=dict)  # per sample
    calls: dict[int, int] = field(default_factory=dict)  # tool calls sent per sample
    prompt_logprobs_sent: bool = False


def stream_response(
    out: RequestOutput, state: StreamState, ctx: ResponseContext
) -> llm_pb2.GenerateResponse | None:
    """The GenerateStream message for one engine output: deltas only; None if nothing new."""
    resp = llm_pb2.GenerateResponse(request_id=ctx.request_id, model=ctx.model)
    for c in out.outputs:
        newly_finished = c.finish_reason is not None and c.index not in state.finished
        if not (c.delta_token_ids or c.delta_text or newly_finished):
            continue
        if c.index not in state.parsers:
            state.parsers[c.index] = ctx.tool_parser()
        parser = state.parsers[c.index]
        text, calls = c.delta_text, []
        if parser is not None:
            events = parser.feed(c.delta_text) + (parser.finish() if newly_finished else [])
            text, calls = _split(events)
            state.calls[c.index] = state.calls.get(c.index, 0) + len(calls)
        dst = resp.completions.add()
        _fill(dst, c, text, c.delta_token_ids, c.delta_logprobs, ctx)
        _add_calls(dst, c, calls, state.calls.get(c.index, 0))
        if newly_finished:
            state.finished.add(c.index)
    if not state.prompt_logprobs_sent:  # the first output once the prompt is done has them
        state.prompt_logprobs_sent = add_prompt_logprobs(resp, out, ctx)
    if out.finished:
        resp.usage.CopyFrom(usage(out))
    elif not (resp.completions or resp.prompt_logprobs):
        return None
    return resp


def final_response(out: RequestOutput, ctx: ResponseContext) -> llm_pb2.GenerateResponse:
    """The Generate response: every sample's whole text, from the last (finished) output."""
    resp = llm_pb2.GenerateResponse(request_id=ctx.request_id, model=ctx.model, usage=usage(out))
    add_prompt_logprobs(resp, out, ctx)
    for c in sorted(out.outputs, key=lambda c: c.index):
        text, calls = c.text, []
        parser = ctx.tool_parser()
        if parser is not None:
            text, calls = _split(parser.feed(c.text) + parser.finish())
        dst = resp.completions.add()
        _fill(dst, c, text, c.token_ids, c.logprobs, ctx)
        _add_calls(dst, c, calls, len(calls))
    return resp


def add_prompt_logprobs(
    resp: llm_pb2.GenerateResponse, out: RequestOutput, ctx: ResponseContext
) -> bool:
    """The prompt's tokens after the first (nothing predicts the first), each with its
    alternatives, when asked for and `out` has them; whether it added them."""
    if ctx.prompt_logprobs is None or out.prompt_logprobs is None:
        return False
    ids = out.prompt_token_ids or ctx.prompt_token_ids
    resp.prompt_logprobs.extend(
        token_logprob(tid, lp, ctx.prompt_logprobs, ctx.token_text)
        for tid, lp in zip(ids[1:], out.prompt_logprobs[1:], strict=False)
        if lp is not None
    )
    return True


def _split(events: list[str | ToolCall]) -> tuple[str, list[ToolCall]]:
    text = "".join(e for e in events if isinstance(e, str))
    return text, [e for e in events if isinstance(e, ToolCall)]


def _add_calls(
    dst: llm_pb2.Completion, c: CompletionOutput, calls: list[ToolCall], total: int
) -> None:
    """A completion's tool calls; a sample that ended normally with calls ends TOOL_CALLS."""
    dst.tool_calls.extend(
        llm_pb2.ToolCall(id=t.id, name=t.name, arguments=t.arguments) for t in calls
    )
    if finish_reason(c.finish_reason, total) == "tool_calls":
        dst.finish_reason = llm_pb2.FINISH_REASON_TOOL_CALLS


def usage(out: RequestOutput) -> llm_pb2.Usage:
    prompt = len(out.prompt_token_ids)
    completion = sum(len(c.token_ids) for c in out.outputs)
    return llm_pb2.Usage(
        prompt_tokens=prompt,
        completion_tokens=completion,
        total_tokens=prompt + completion,
        cached_prompt_tokens=out.num_cached_tokens,
    )


def _fill(
    dst: llm_pb2.Completion,
    c: CompletionOutput,
    text: str,
    token_ids: list[int],
    logprobs: list[TokenLogprobs] | None,
    ctx: ResponseContext,
) -> None:
    dst.index = c.index
    dst.text = text
    dst.token_ids.extend(token_ids)
    if logprobs:
        dst.logprobs.extend(
            token_logprob(tok, lp, ctx.top_logprobs, ctx.token_text)
            for tok, lp in zip(token_ids, logprobs, strict=False)
        )
    if c.finish_reason is not None:
        dst.finish_reason = _FINISH_REASONS.get(c.finish_reason, llm_pb2.FINISH_REASON_STOP)
        if isinstance(c.stop_reason, str):
            dst.stop_str = c.stop_reason
        elif isinstance(c.stop_reason, int) and not isinstance(c.stop_reason, bool):
            dst.stop_token_id = c.stop_reason


def token_logprob(
    token_id: int, position: TokenLogprobs, top_n: int, token_text: TokenText | None = None
) -> llm_pb2.TokenLogprob:
    """One position: the chosen token's logprob plus the top_n best, most likely first.

    The engine hands `{token_id: logprob}` holding the top-N and the chosen token (which
    sampling may pick from outside the top-N, making N + 1 entries).
    """
    text = token_text or (lambda _: "")
    ranked = sorted(position.items(), key=lambda kv: kv[1], reverse=True)[:top_n]
    return llm_pb2.TokenLogprob(
        token_id=token_id,
        token=text(token_id),
        logprob=position.get(token_id, float("nan")),
        top_logprobs=[
            llm_pb2.TopLogprob(token_id=t, token=text(t), logprob=lp) for t, lp in ranked
        ],
    )

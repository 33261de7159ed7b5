"""The engine's RequestOutputs -> kvray.v1 GenerateResponses, whole (Generate) or as deltas
(GenerateStream).

A chat's output is read the way the HTTP ingress reads it (cluster/http/format.py), with the
same reader (cluster/ingress/reasoning.py `AnswerReader`): with a reasoning parser on, the
thinking goes to `Completion.reasoning` and `text` keeps only the answer; with tools, calls are
read from the answer only, never from the thinking. A whole output is one `feed` of the reader
and a stream one `feed` per delta, so Generate and GenerateStream split an output the same way.
With neither tools nor a reasoning parser the text is the output as the model wrote it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from cluster.ingress.reasoning import AnswerReader, Piece, Thought
from cluster.ingress.tool_calls import ToolCall, ToolCallReader, finish_reason
from kvray.v1 import llm_pb2

if TYPE_CHECKING:
    from cluster.ingress.output_parsing import Reasoning
    from cluster.ingress.tools import ToolUse
    from workers.outputs import CompletionOutput, RequestOutput, TokenLogprobs

TokenText = Callable[[int], str]
_FINISH_REASONS = {
    "stop": llm_pb2.FINISH_REASON_STOP,
    "length": llm_pb2.FINISH_REASON_LENGTH,
    "abort": llm_pb2.FINISH_REASON_ABORT,
    "tool_calls": llm_pb2.FINISH_REASON_TOOL_CALLS,
}


@dataclass(frozen=True)
class ResponseContext:
    """Per-request constants of the responses: ids, how to render logprobs, how to read the
    output (tool calls, reasoning)."""

    request_id: str
    model: str
    top_logprobs: int = 0  # alternatives per position (the request's LogprobsOptions)
    token_text: TokenText | None = None  # token id -> its text; None leaves `token` empty
    tools: ToolUse | None = None  # chat tools: the output is read for calls when they parse
    # GenerateRequest.prompt_logprobs (alternatives per prompt position; None: not asked) and
    # the prompt they score (a streamed output does not repeat it).
    prompt_logprobs: int | None = None
    prompt_token_ids: tuple[int, ...] = ()
    # A chat's reasoning (the Preparer's `outputs.reasoning`); None: the parser is off, or not
    # a chat, and the output is not split.
    reasoning: Reasoning | None = None

    def tool_parser(self) -> ToolCallReader | None:
        if self.tools is None or not self.tools.parses:
            return None
        return self.tools.parser()

    def reader(self) -> AnswerReader | None:
        """A reader of one completion's output; None when its text is returned as written."""
        parser = self.tool_parser()
        if parser is None and self.reasoning is None:
            return None
        return AnswerReader(self.reasoning, parser)


@dataclass
class StreamState:
    """What a GenerateStream has already told the client (finish is sent once per sample)."""

    finished: set[int] = field(default_factory=set)
    readers: dict[int, AnswerReader | None] = field(default_factory=dict)  # per sample
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
        if c.index not in state.readers:
            state.readers[c.index] = ctx.reader()
        reader = state.readers[c.index]
        text, thought, calls = c.delta_text, "", []
        if reader is not None:
            text, thought, calls = _split(reader.feed(c.delta_text, newly_finished))
            state.calls[c.index] = state.calls.get(c.index, 0) + len(calls)
        dst = resp.completions.add()
        _fill(dst, c, text, c.delta_token_ids, c.delta_logprobs, ctx)
        dst.reasoning = thought
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
        text, thought, calls = c.text, "", []
        reader = ctx.reader()
        if reader is not None:
            text, thought, calls = _split(reader.feed(c.text, finished=True))
        dst = resp.completions.add()
        _fill(dst, c, text, c.token_ids, c.logprobs, ctx)
        dst.reasoning = thought
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


def _split(pieces: list[Piece]) -> tuple[str, str, list[ToolCall]]:
    """(answer text, reasoning text, tool calls) of what a reader returned."""
    text = "".join(p for p in pieces if isinstance(p, str))
    thought = "".join(p.text for p in pieces if isinstance(p, Thought))
    return text, thought, [p for p in pieces if isinstance(p, ToolCall)]


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

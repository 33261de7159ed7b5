"""Anthropic Messages API answers built from engine RequestOutputs (plain dicts).

A message's `content` is a list of blocks: `text` blocks and `tool_use` blocks
(`{id, name, input}`), after one `thinking` block (`{thinking, signature: ""}`) when a
reasoning parser is on and the model thought (cluster/ingress/reasoning.py). The model's
answer becomes blocks in the order it is written: text opens a text block, a call closes it
and adds a tool_use block, text after a call opens a new text block. With tools (not
tool_choice "none") the answer is read by chat's tool-call parser
(cluster/ingress/tool_calls.py), so the calls are those the chat API would return. A streamed
message and a whole one are built by the same `ContentBlocks`, so they hold the same blocks;
streamed, each change is also an event, in Anthropic's order:

    message_start (the message, empty, stop_reason null), ping
    thinking block:     content_block_start, content_block_delta (thinking_delta) ...,
                        content_block_delta (signature_delta, ""), content_block_stop
    per text block:     content_block_start, content_block_delta (text_delta) ...,
                        content_block_stop
    per tool_use block: content_block_start (input {}), content_block_delta
                        (input_json_delta: the whole arguments, as kvray sends a call once
                        it is whole), content_block_stop
    message_delta (stop_reason, stop_sequence, usage.output_tokens), message_stop

Each event is an SSE frame `event: TYPE` + `data: {"type": TYPE, ...}`; a failure after the
stream started is an `error` event in Anthropic's error shape, and the stream ends there.

`stop_reason`: the engine's "stop" is `tool_use` when the output holds calls, `stop_sequence`
when one of `stop_sequences` matched (named in `stop_sequence`), else `end_turn`; "length" is
`max_tokens`. An output the engine aborted is an api_error. Usage: `input_tokens` is the whole
prompt (chat's prompt_tokens; prefix-cache hits are not split out), `output_tokens` the
generated tokens.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any

from cluster.errors import KvrayError
from cluster.http import messages_errors
from cluster.http.messages_input import tool_input
from cluster.http.streams import close_all
from cluster.ingress.output_parsing import Reasoning
from cluster.ingress.reasoning import AnswerReader, Thought
from cluster.ingress.tool_calls import ToolCall
from cluster.ingress.tools import ToolUse
from workers.outputs import CompletionOutput, RequestOutput


class EngineAbortedError(KvrayError):
    """The engine gave up on the request (e.g. a grammar that timed out): HTTP 500."""

    def __init__(self) -> None:
        super().__init__("the engine aborted the request")


def stop_reason(c: CompletionOutput, calls: int) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) of a finished output that holds `calls` tool calls."""
    if c.finish_reason == "length":
        return "max_tokens", None
    if c.finish_reason != "stop":
        raise EngineAbortedError()
    if calls:
        return "tool_use", None
    if isinstance(c.stop_reason, str):
        return "stop_sequence", c.stop_reason
    return "end_turn", None


def tool_use_id(call: ToolCall) -> str:
    """Anthropic's id spelling (toolu_...) of a parsed call's id (call_...)."""
    return "toolu_" + call.id.removeprefix("call_")


class ContentBlocks:
    """A message's content blocks, built as the model's text arrives; with `record`, each
    change is also kept as the stream events describing it (`events`)."""

    def __init__(self, reader: AnswerReader, record: bool) -> None:
        self.reader = reader  # the reasoning split off, the answer read for calls
        self.record = record
        self.blocks: list[dict[str, Any]] = []
        self.events: list[dict[str, Any]] = []
        self.calls = 0
        self._open: dict[str, Any] | None = None  # the open text or thinking block

    def feed(self, text: str, finished: bool) -> None:
        """The model's new text: its thinking, then its answer's text and calls."""
        for e in self.reader.feed(text, finished):
            if isinstance(e, ToolCall):
                self._add_call(e)
            elif isinstance(e, Thought):
                self._add("thinking", e.text)
            else:
                self._add("text", e)
        if finished:
            self._close()

    def _emit(self, kind: str, **fields: Any) -> None:
        if self.record:
            self.events.append({"type": kind, **fields})

    def _add(self, kind: str, delta: str) -> None:
        """Text into the open block of `kind` (a text or thinking block), opened if need be."""
        if not delta:
            return
        block = self._open
        if block is None or block["type"] != kind:
            self._close()  # the thinking ends where the answer starts
            block = {"type": kind, kind: ""}
            if kind == "thinking":
                block["signature"] = ""  # kvray does not sign its reasoning
            self._open = block
            self.blocks.append(block)
            self._emit("content_block_start", index=self._index, content_block=dict(block))
        block[kind] += delta
        self._emit(
            "content_block_delta", index=self._index, delta={"type": f"{kind}_delta", kind: delta}
        )

    def _add_call(self, call: ToolCall) -> None:
        self._close()
        self.calls += 1
        block = {
            "type": "tool_use",
            "id": tool_use_id(call),
            "name": call.name,
            "input": tool_input(call.arguments),
        }
        self.blocks.append(block)
        self._emit("content_block_start", index=self._index, content_block={**block, "input": {}})
        delta = {"type": "input_json_delta", "partial_json": call.arguments}
        self._emit("content_block_delta", index=self._index, delta=delta)
        self._emit("content_block_stop", index=self._index)

    def _close(self) -> None:
        block, self._open = self._open, None
        if block is None:
            return
        if block["type"] == "thinking":  # Anthropic ends a thinking block with its signature
            delta = {"type": "signature_delta", "signature": block["signature"]}
            self._emit("content_block_delta", index=self._index, delta=delta)
        self._emit("content_block_stop", index=self._index)

    @property
    def _index(self) -> int:
        return len(self.blocks) - 1


class MessagesFormatter:
    """Builds one Messages request's answer: the Message (`response`), or its stream events
    (`start`, then `chunks` per engine output). `input_tokens`: the prompt's length;
    `reasoning`: the request's reasoning (None: no reasoning parser)."""

    def __init__(
        self,
        model: str,
        tools: ToolUse | None,
        input_tokens: int,
        reasoning: Reasoning | None = None,
    ) -> None:
        self.id = f"msg_{uuid.uuid4().hex}"  # also the engine request's id
        self.model = model
        self.tools = tools if tools is not None and tools.parses else None
        self.input_tokens = input_tokens
        self.reasoning = reasoning
        self.finished = False  # the stream's last event went out
        self._blocks = ContentBlocks(self._reader(), record=True)  # the streamed message's
        self._output_tokens = 0

    def _reader(self) -> AnswerReader:
        parser = self.tools.parser() if self.tools is not None else None
        return AnswerReader(self.reasoning, parser)

    def message(
        self,
        content: list[dict[str, Any]],
        reason: str | None,
        sequence: str | None,
        output_tokens: int,
    ) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": content,
            "stop_reason": reason,
            "stop_sequence": sequence,
            "usage": {"input_tokens": self.input_tokens, "output_tokens": output_tokens},
        }

    def response(self, finals: Sequence[RequestOutput]) -> dict[str, Any]:
        """The non-streamed Message from the final output (a message has one prompt)."""
        (out,) = finals
        c = out.outputs[0]
        blocks = ContentBlocks(self._reader(), record=False)
        blocks.feed(c.text, finished=True)
        reason, sequence = stop_reason(c, blocks.calls)
        return self.message(blocks.blocks, reason, sequence, len(c.token_ids))

    # -- streaming -------------------------------------------------------------------------

    def start(self) -> list[str]:
        """The events before any output: the message, empty, and a ping."""
        return [
            self.event("message_start", message=self.message([], None, None, 0)),
            self.event("ping"),
        ]

    def chunks(self, out: RequestOutput, prompt_index: int = 0) -> list[str]:
        """The events of one engine output (a delta); the last ends the message."""
        if self.finished:
            return []
        c = out.outputs[0]
        done = c.finish_reason is not None
        self._output_tokens += len(c.delta_token_ids)
        self._blocks.feed(c.delta_text, finished=done)
        frames = [self.event(e.pop("type"), **e) for e in self._blocks.events]
        self._blocks.events.clear()
        if done:
            reason, sequence = stop_reason(c, self._blocks.calls)
            tokens = len(c.token_ids) or self._output_tokens
            frames.append(
                self.event(
                    "message_delta",
                    delta={"stop_reason": reason, "stop_sequence": sequence},
                    usage={"output_tokens": tokens},
                )
            )
            frames.append(self.event("message_stop"))
            self.finished = True
        return frames

    def error_event(self, err: KvrayError) -> str:
        """A failure after the stream started (its status line is sent): the last event."""
        self.finished = True
        _, body = messages_errors.from_error(err)
        return _frame("error", body)

    def event(self, kind: str, **fields: Any) -> str:
        return _frame(kind, {"type": kind, **fields})


def _frame(kind: str, body: dict[str, Any]) -> str:
    data = json.dumps(body, separators=(",", ":"), ensure_ascii=False)
    return f"event: {kind}\ndata: {data}\n\n"


async def sse_events(
    fmt: MessagesFormatter,
    streams: Sequence[AsyncIterator[Any]],
    firsts: Sequence[Any],
    include_usage: bool = False,
) -> AsyncIterator[str]:
    """The SSE body of a streamed message (the ingress's `run` calls it as it calls chat's
    `sse_frames`); the usage is always in message_start and message_delta."""
    (stream,), (first,) = streams, firsts
    try:
        head = fmt.start()
        try:
            head += fmt.chunks(first)
        except KvrayError as err:  # the first output was an abort
            head.append(fmt.error_event(err))
        yield "".join(head)
        async for out in stream:
            if fmt.finished:
                break
            frames = fmt.chunks(out)
            if frames:
                yield "".join(frames)
        if not fmt.finished:  # never expected: a stream must end with a finished output
            yield fmt.error_event(KvrayError("the engine's stream ended before the message"))
    except KvrayError as err:  # mid-stream failure (or an abort): the status line is sent
        yield fmt.error_event(err)
    finally:
        await close_all(streams)

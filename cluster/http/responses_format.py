"""Responses API objects and stream events built from engine RequestOutputs (plain dicts).

A response's `output` is a list of items: `message` items (the assistant's text, one
`output_text` part) and `function_call` items (one per call), after one `reasoning` item
(the thinking, one `reasoning_text` part; `summary` is empty) when a reasoning parser is on
and the model thought (cluster/ingress/reasoning.py). The model's text becomes items in the
order it is written: text opens a message item, a call closes it and adds a function_call
item, text after a call opens a new message. With tools (not tool_choice "none") the answer
is read by chat's tool-call parser (cluster/ingress/tool_calls.py), so calls are the same
calls the chat API would return. A streamed response and a whole one are built by the same
`OutputItems`, so they hold the same items; streamed, each change is also an event:

    response.created, response.in_progress
    reasoning:    response.output_item.added, response.content_part.added,
                  response.reasoning_text.delta ..., response.reasoning_text.done,
                  response.content_part.done, response.output_item.done
    per message:  response.output_item.added, response.content_part.added,
                  response.output_text.delta ..., response.output_text.done,
                  response.content_part.done, response.output_item.done
    per call:     response.output_item.added, response.function_call_arguments.delta,
                  response.function_call_arguments.done, response.output_item.done
    response.completed | response.incomplete (max_output_tokens) | response.failed

Each event is an SSE frame `event: TYPE` + `data: {"type": TYPE, "sequence_number": N, ...}`;
a failure after the stream started is an `error` event, and the stream ends there. There is
no `data: [DONE]` (OpenAI sends none on this API).
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any

from cluster.errors import KvrayError
from cluster.http.streams import close_all
from cluster.ingress.output_parsing import Reasoning
from cluster.ingress.reasoning import AnswerReader, Thought
from cluster.ingress.tool_calls import ToolCall
from cluster.ingress.tools import ToolUse
from workers.outputs import RequestOutput

FINAL_EVENTS = {
    "completed": "response.completed",
    "incomplete": "response.incomplete",
    "failed": "response.failed",
}


def usage(out: RequestOutput) -> dict[str, Any]:
    prompt = len(out.prompt_token_ids)
    generated = sum(len(c.token_ids) for c in out.outputs)
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": out.num_cached_tokens, "cache_write_tokens": 0},
        "output_tokens": generated,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt + generated,
    }


def status_of(finish_reason: str | None) -> tuple[str, dict[str, Any] | None, Any]:
    """(status, incomplete_details, error) of a finished output."""
    if finish_reason == "length":
        return "incomplete", {"reason": "max_output_tokens"}, None
    if finish_reason == "abort":  # the engine gave up on it (e.g. a grammar that timed out)
        return "failed", None, {"code": "server_error", "message": "the engine aborted the request"}
    return "completed", None, None


def _copy(item: dict[str, Any]) -> dict[str, Any]:
    """A snapshot of an item (its content parts are the only nested mutable values)."""
    out = dict(item)
    if "content" in out:
        out["content"] = [dict(p) for p in out["content"]]
    return out


class OutputItems:
    """A response's output items, built as the model's text arrives; with `record`, each
    change is also kept as the stream events describing it (`events`, no sequence numbers)."""

    def __init__(self, record: bool) -> None:
        self.items: list[dict[str, Any]] = []
        self.events: list[dict[str, Any]] = []
        self.record = record
        self._open: dict[str, Any] | None = None  # the open message or reasoning item
        self._index = -1  # its output_index

    def _emit(self, kind: str, **fields: Any) -> None:
        if self.record:
            self.events.append({"type": kind, **fields})

    def text(self, delta: str) -> None:
        self._add("message", delta)

    def reasoning(self, delta: str) -> None:
        self._add("reasoning", delta)

    def _add(self, kind: str, delta: str) -> None:
        if not delta:
            return
        item = self._open
        if item is None or item["type"] != kind:
            self.close("completed")  # the reasoning ends where the answer starts
            item = self._open_item(kind)
        item["content"][0]["text"] += delta
        where = {"item_id": item["id"], "output_index": self._index, "content_index": 0}
        if kind == "message":
            self._emit("response.output_text.delta", **where, delta=delta, logprobs=[])
        else:
            self._emit("response.reasoning_text.delta", **where, delta=delta)

    def call(self, call: ToolCall) -> None:
        """A whole call: kvray sends a call once it is complete, its arguments in one delta."""
        self.close("completed")
        index = len(self.items)
        item = {
            "id": f"fc_{uuid.uuid4().hex}",
            "type": "function_call",
            "call_id": call.id,
            "name": call.name,
            "arguments": call.arguments,
            "status": "completed",
        }
        self.items.append(item)
        where = {"item_id": item["id"], "output_index": index}
        started = {**item, "arguments": "", "status": "in_progress"}
        self._emit("response.output_item.added", output_index=index, item=started)
        self._emit("response.function_call_arguments.delta", **where, delta=call.arguments)
        self._emit("response.function_call_arguments.done", **where, arguments=call.arguments)
        self._emit("response.output_item.done", output_index=index, item=dict(item))

    def finish(self, status: str) -> None:
        """The end of the output: the open item closes with `status` (an output of nothing
        is one empty message, so `output_text` is ""; one that ended while the model was
        thinking is its reasoning item alone)."""
        if not self.items:
            self._open_item("message")
        self.close(status)

    def close(self, status: str) -> None:
        item, self._open = self._open, None
        if item is None:
            return
        item["status"] = status
        part = item["content"][0]
        where = {"item_id": item["id"], "output_index": self._index, "content_index": 0}
        if item["type"] == "message":
            self._emit("response.output_text.done", **where, text=part["text"], logprobs=[])
        else:
            self._emit("response.reasoning_text.done", **where, text=part["text"])
        self._emit("response.content_part.done", **where, part=dict(part))
        self._emit("response.output_item.done", output_index=self._index, item=_copy(item))

    def _open_item(self, kind: str) -> dict[str, Any]:
        """A new message (one output_text part) or reasoning item (one reasoning_text part)."""
        item: dict[str, Any]
        if kind == "message":
            item = {"id": f"msg_{uuid.uuid4().hex}", "type": "message", "role": "assistant"}
            part = {"type": "output_text", "text": "", "annotations": []}
        else:
            item = {"id": f"rs_{uuid.uuid4().hex}", "type": "reasoning", "summary": []}
            part = {"type": "reasoning_text", "text": ""}
        item.update(status="in_progress", content=[])
        self.items.append(item)
        self._open, self._index = item, len(self.items) - 1
        self._emit("response.output_item.added", output_index=self._index, item=_copy(item))
        item["content"].append(part)
        where = {"item_id": item["id"], "output_index": self._index, "content_index": 0}
        self._emit("response.content_part.added", **where, part=dict(part))
        return item


class ResponsesFormatter:
    """Builds one Responses request's answer: the Response object (`response`), or its
    stream events (`start`, then `chunks` per engine output). `echo` holds the request's
    settings as the object repeats them (ResponsesRequest.echo); `reasoning`: the request's
    reasoning (None: no reasoning parser)."""

    def __init__(
        self,
        echo: dict[str, Any],
        model: str,
        tools: ToolUse | None,
        reasoning: Reasoning | None = None,
    ) -> None:
        self.id = f"resp_{uuid.uuid4().hex}"  # also the engine request's id
        self.model = model
        self.echo = echo
        self.tools = tools if tools is not None and tools.parses else None
        self.reasoning = reasoning
        self.created_at = int(time.time())
        self.finished = False  # the stream's last event went out
        self._sequence = 0
        self._items = OutputItems(record=True)  # the streamed response's
        self._reader = self._new_reader()

    def _new_reader(self) -> AnswerReader:
        parser = self.tools.parser() if self.tools is not None else None
        return AnswerReader(self.reasoning, parser)

    def body(
        self,
        status: str,
        output: list[dict[str, Any]],
        usage_: dict[str, Any] | None = None,
        incomplete: dict[str, Any] | None = None,
        error: Any = None,
    ) -> dict[str, Any]:
        """The Response object."""
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "completed_at": int(time.time()) if status == "completed" else None,
            "error": error,
            "incomplete_details": incomplete,
            "model": self.model,
            "output": output,
            "usage": usage_,
            **self.echo,
        }

    def response(self, finals: Sequence[RequestOutput]) -> dict[str, Any]:
        """The non-streamed Response from the final output (a response has one prompt)."""
        (out,) = finals
        items = OutputItems(record=False)
        _feed(items, self._new_reader(), out.outputs[0].text, finished=True)
        return self._final(items, out)

    def _final(self, items: OutputItems, out: RequestOutput) -> dict[str, Any]:
        status, incomplete, error = status_of(out.outputs[0].finish_reason)
        items.finish("completed" if status == "completed" else "incomplete")
        return self.body(status, items.items, usage(out), incomplete, error)

    # -- streaming -------------------------------------------------------------------------

    def start(self) -> list[str]:
        """The events before any output: the response, in progress, with no items yet."""
        snapshot = self.body("in_progress", [])
        return [
            self.event("response.created", response=snapshot),
            self.event("response.in_progress", response=snapshot),
        ]

    def chunks(self, out: RequestOutput, prompt_index: int = 0) -> list[str]:
        """The events of one engine output (a delta); the last closes the response."""
        if self.finished:
            return []
        c = out.outputs[0]
        done = c.finish_reason is not None
        _feed(self._items, self._reader, c.delta_text, finished=done)
        final = self._final(self._items, out) if done else None
        frames = [self.event(e.pop("type"), **e) for e in self._items.events]
        self._items.events.clear()
        if final is not None:
            self.finished = True
            frames.append(self.event(FINAL_EVENTS[final["status"]], response=final))
        return frames

    def error_event(self, err: KvrayError) -> str:
        """A failure after the stream started (its status line is sent): the last event."""
        self.finished = True
        return self.event("error", code=err.openai_type, message=err.message, param=err.param)

    def event(self, kind: str, **fields: Any) -> str:
        body = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        data = json.dumps(body, separators=(",", ":"), ensure_ascii=False)
        return f"event: {kind}\ndata: {data}\n\n"


def _feed(items: OutputItems, reader: AnswerReader, text: str, finished: bool) -> None:
    """The model's new text into items: its reasoning, then its answer's text and calls."""
    for e in reader.feed(text, finished):
        if isinstance(e, ToolCall):
            items.call(e)
        elif isinstance(e, Thought):
            items.reasoning(e.text)
        else:
            items.text(e)


async def sse_events(
    fmt: ResponsesFormatter,
    streams: Sequence[AsyncIterator[Any]],
    firsts: Sequence[Any],
    include_usage: bool = False,
) -> AsyncIterator[str]:
    """The SSE body of a streamed response (the ingress's `run` calls it as it calls chat's
    `sse_frames`); the usage is always in the final response object."""
    (stream,), (first,) = streams, firsts
    try:
        yield "".join(fmt.start() + fmt.chunks(first))
        async for out in stream:
            frames = fmt.chunks(out)
            if frames:
                yield "".join(frames)
        if not fmt.finished:  # never expected: a stream must end with a finished output
            yield fmt.error_event(KvrayError("the engine's stream ended before the response"))
    except KvrayError as err:  # mid-stream failure: the status line is already sent
        yield fmt.error_event(err)
    finally:
        await close_all(streams)

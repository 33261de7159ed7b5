"""The Messages formatter without Ray: its Message and stream events are what the official
`anthropic` client's own models accept, in Anthropic's order, a streamed message holds what
the whole one does, and stop reasons and usage follow the engine's output."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
from anthropic.types import Message, RawMessageStreamEvent
from pydantic import TypeAdapter

from cluster.errors import QueueTimeoutError
from cluster.http.messages_format import EngineAbortedError, MessagesFormatter, sse_events
from cluster.ingress.output_parsing import Reasoning
from cluster.ingress.tools import Tool, ToolChoice, ToolUse
from workers.outputs import CompletionOutput, RequestOutput

EVENTS: TypeAdapter[Any] = TypeAdapter(RawMessageStreamEvent)
ARGS = '{"city": "Paris"}'
WEATHER = Tool("weather", "", {"type": "object", "properties": {"city": {"type": "string"}}})


def _outputs(
    pieces: list[str], finish: str, stop: str | None = None, prompt_tokens: int = 5
) -> list[RequestOutput]:
    """The DELTA outputs of an engine request whose text arrives in `pieces` (one token
    each; the last output carries the cumulative text and token ids, as the engine's does)."""
    outs = []
    for i, piece in enumerate(pieces):
        last = i == len(pieces) - 1
        c = CompletionOutput(
            0,
            text="".join(pieces) if last else "",
            token_ids=list(range(len(pieces))) if last else [],
            finish_reason=finish if last else None,
            stop_reason=stop if last else None,
            delta_text=piece,
            delta_token_ids=[i],
        )
        outs.append(RequestOutput("r", None, list(range(prompt_tokens)), [c], last))
    return outs


def _formatter(mode: str | None = None, reasoning: Reasoning | None = None) -> MessagesFormatter:
    tools = None if mode is None else ToolUse((WEATHER,), ToolChoice(mode, None))
    return MessagesFormatter("kvray-demo", tools, 5, reasoning)


def _events(frames: list[str]) -> list[dict[str, Any]]:
    """Each SSE frame's event, checked against its `event:` line and anthropic's models."""
    out = []
    for frame in "".join(frames).removesuffix("\n\n").split("\n\n"):
        head, data = frame.split("\n")
        event = json.loads(data.removeprefix("data: "))
        assert head == f"event: {event['type']}"
        if event["type"] not in ("ping", "error"):
            EVENTS.validate_python(event)
        out.append(event)
    return out


def _stream(fmt: MessagesFormatter, outs: list[RequestOutput]) -> list[dict[str, Any]]:
    frames = fmt.start()
    for out in outs:
        frames += fmt.chunks(out)
    return _events(frames)


def _snapshot(events: list[dict[str, Any]]) -> dict[str, Any]:
    """The message a client assembles from the events (as the SDK's accumulator does)."""
    message = events[0]["message"]
    json_bufs: dict[int, str] = {}
    for e in events[1:]:
        if e["type"] == "content_block_start":
            message["content"].append(dict(e["content_block"]))
        elif e["type"] == "content_block_delta":
            block, delta = message["content"][e["index"]], e["delta"]
            if delta["type"] == "text_delta":
                block["text"] += delta["text"]
            elif delta["type"] == "thinking_delta":
                block["thinking"] += delta["thinking"]
            elif delta["type"] == "signature_delta":
                block["signature"] = delta["signature"]
            else:
                json_bufs[e["index"]] = json_bufs.get(e["index"], "") + delta["partial_json"]
                block["input"] = json.loads(json_bufs[e["index"]])
        elif e["type"] == "message_delta":
            message.update(e["delta"])
            message["usage"]["output_tokens"] = e["usage"]["output_tokens"]
    return message


def _without_id(message: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in message.items() if k != "id"}


def test_text_streams_in_anthropics_event_order() -> None:
    outs = _outputs(["Hel", "lo", "!"], "stop")
    fmt = _formatter()
    events = _stream(fmt, outs)
    assert [e["type"] for e in events] == [
        "message_start",
        "ping",
        "content_block_start",
        "content_block_delta",
        "content_block_delta",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    start = events[0]["message"]
    assert start["content"] == [] and start["stop_reason"] is None
    assert start["usage"] == {"input_tokens": 5, "output_tokens": 0}
    assert events[-2]["delta"] == {"stop_reason": "end_turn", "stop_sequence": None}
    assert events[-2]["usage"] == {"output_tokens": 3}
    whole = _formatter().response([outs[-1]])
    Message.model_validate(whole)
    assert whole["id"].startswith("msg_") and whole["content"] == [
        {"type": "text", "text": "Hello!"}
    ]
    assert _without_id(_snapshot(events)) == _without_id(whole)
    assert fmt.chunks(outs[-1]) == []  # nothing after message_stop


@pytest.mark.parametrize(
    ("finish", "stop", "reason", "sequence"),
    [("length", None, "max_tokens", None), ("stop", "##", "stop_sequence", "##")],
)
def test_stop_reasons(finish: str, stop: str | None, reason: str, sequence: str | None) -> None:
    (out,) = _outputs(["a b"], finish, stop)
    whole = _formatter().response([out])
    assert (whole["stop_reason"], whole["stop_sequence"]) == (reason, sequence)
    assert whole["usage"] == {"input_tokens": 5, "output_tokens": 1}


def test_calls_are_tool_use_blocks_streamed_or_not() -> None:
    call = '{"name": "weather", "arguments": ' + ARGS + "}"
    pieces = ["Let me ", "check.<tool_", f"call>{call[:40]}", f"{call[40:]}</tool_call>", " Done"]
    outs = _outputs(pieces, "stop")
    whole = _formatter("auto").response([outs[-1]])
    Message.model_validate(whole)
    assert whole["stop_reason"] == "tool_use"
    text, call, tail = whole["content"]
    assert text == {"type": "text", "text": "Let me check."} and tail["text"] == " Done"
    assert call["type"] == "tool_use" and call["id"].startswith("toolu_")
    assert (call["name"], call["input"]) == ("weather", {"city": "Paris"})
    events = _stream(_formatter("auto"), outs)
    starts = [e["content_block"]["type"] for e in events if e["type"] == "content_block_start"]
    assert starts == ["text", "tool_use", "text"]
    (delta,) = [
        e["delta"] for e in events if e.get("index") == 1 and e["type"] == "content_block_delta"
    ]
    assert delta == {"type": "input_json_delta", "partial_json": ARGS}
    snapshot = _snapshot(events)
    assert [b.get("text", b.get("input")) for b in snapshot["content"]] == [
        "Let me check.",
        {"city": "Paris"},
        " Done",
    ]
    assert snapshot["stop_reason"] == "tool_use"


def test_a_forced_call_is_the_only_block() -> None:
    outs = _outputs(['[{"name": "weather", ', f'"arguments": {ARGS}', "}]"], "stop")
    whole = _formatter("required").response([outs[-1]])
    ((block),) = whole["content"]
    assert block["input"] == {"city": "Paris"} and whole["stop_reason"] == "tool_use"


def test_an_aborted_output_is_an_error() -> None:
    (out,) = _outputs(["x"], "abort")
    with pytest.raises(EngineAbortedError):
        _formatter().response([out])


async def _from(outs: list[Any]) -> AsyncIterator[Any]:
    for out in outs:
        if isinstance(out, Exception):
            raise out
        yield out


def _sse(outs: list[Any]) -> list[dict[str, Any]]:
    async def collect() -> list[str]:
        stream = _from(outs)
        first = await anext(stream)
        return [f async for f in sse_events(_formatter(), [stream], [first])]

    return _events(asyncio.run(collect()))


def test_the_sse_body_ends_with_message_stop() -> None:
    events = _sse(_outputs(["a", "b"], "stop"))
    assert events[0]["type"] == "message_start" and events[-1]["type"] == "message_stop"


def test_a_failure_mid_stream_is_an_error_event_in_anthropics_shape() -> None:
    events = _sse([*_outputs(["a", "b"], "stop")[:1], QueueTimeoutError()])
    assert events[-1] == {
        "type": "error",
        "error": {"type": "overloaded_error", "message": "request timed out in the queue"},
    }
    aborted = _sse(_outputs(["a"], "abort"))
    assert aborted[-1]["type"] == "error" and aborted[-1]["error"]["type"] == "api_error"


# -- reasoning (a reasoning parser on) --------------------------------------------------------

QWEN3 = Reasoning("qwen3", inside=False, may_open=True)
R1 = Reasoning("deepseek_r1", inside=True)
THOUGHT = "<think>\nTwo and two.\n</think>\n\nFour."


@pytest.mark.parametrize("size", [1, 4, 1000])
def test_the_thinking_is_a_block_before_the_text(size: int) -> None:
    outs = _outputs([THOUGHT[i : i + size] for i in range(0, len(THOUGHT), size)], "stop")
    whole = _formatter(reasoning=QWEN3).response([outs[-1]])
    assert whole["content"] == [
        {"type": "thinking", "thinking": "Two and two.", "signature": ""},
        {"type": "text", "text": "Four."},
    ]
    Message.model_validate(whole)
    events = _stream(_formatter(reasoning=QWEN3), outs)
    thinking = [e for e in events if e.get("index") == 0]
    assert thinking[0]["type"] == "content_block_start"
    assert thinking[0]["content_block"] == {"type": "thinking", "thinking": "", "signature": ""}
    deltas = [e["delta"] for e in thinking if e["type"] == "content_block_delta"]
    assert {d["type"] for d in deltas[:-1]} == {"thinking_delta"}
    assert deltas[-1] == {"type": "signature_delta", "signature": ""}  # just before the stop
    assert thinking[-1]["type"] == "content_block_stop"
    assert events.index(thinking[-1]) < events.index(next(e for e in events if e.get("index") == 1))
    assert _without_id(_snapshot(events)) == _without_id(whole)


def test_calls_after_the_thinking_are_tool_use_blocks() -> None:
    call = '<tool_call>{"name": "weather", "arguments": ' + ARGS + "}</tool_call>"
    text = f"Use the tool: {call}</think>{call}"  # a call rehearsed in the thinking is thinking
    outs = _outputs([text[i : i + 5] for i in range(0, len(text), 5)], "stop")
    whole = _formatter("auto", R1).response([outs[-1]])
    assert [b["type"] for b in whole["content"]] == ["thinking", "tool_use"]
    assert whole["content"][0]["thinking"] == f"Use the tool: {call}"
    assert whole["stop_reason"] == "tool_use"
    snapshot = _snapshot(_stream(_formatter("auto", R1), outs))
    assert [_without_id(b) for b in snapshot["content"]] == [
        _without_id(b) for b in whole["content"]
    ]


def test_cut_off_while_thinking_is_the_thinking_block_alone() -> None:
    outs = _outputs(["Two and", " two"], "length")
    whole = _formatter(reasoning=R1).response([outs[-1]])
    assert whole["content"] == [{"type": "thinking", "thinking": "Two and two", "signature": ""}]
    assert whole["stop_reason"] == "max_tokens"
    assert _without_id(_snapshot(_stream(_formatter(reasoning=R1), outs))) == _without_id(whole)


def test_without_a_parser_the_thinking_stays_in_the_text() -> None:
    whole = _formatter().response([_outputs([THOUGHT], "stop")[-1]])
    assert whole["content"] == [{"type": "text", "text": THOUGHT}]

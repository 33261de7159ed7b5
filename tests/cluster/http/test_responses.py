"""/v1/responses without Ray: a Responses request prepares the engine input the equivalent
chat request does; bad or unsupported fields are 400s naming them; the formatter's objects
and stream events are what the official `openai` client's own models accept, in order."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from cluster.errors import InvalidRequestError, QueueTimeoutError
from cluster.http.responses import ResponsesRequest, prepare
from cluster.http.responses_format import ResponsesFormatter, sse_events
from cluster.ingress.prepare import Prepared, Preparer
from tests.cluster.http.demo_preparer import demo_preparer, prepare_chat
from workers.outputs import CompletionOutput, RequestOutput

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
    "required": ["city"],
    "additionalProperties": False,
}
TOOLS = [{"type": "function", "name": "weather", "description": "Forecast", "parameters": WEATHER}]
CHAT_TOOLS = [
    {
        "type": "function",
        "function": {"name": "weather", "description": "Forecast", "parameters": WEATHER},
    }
]
ARGS = '{"city": "Paris"}'
EVENTS: TypeAdapter[Any] = TypeAdapter(ResponseStreamEvent)


@pytest.fixture(scope="module")
def preparer() -> Preparer:
    return demo_preparer()


def _responses(preparer: Preparer, **kw: Any) -> Prepared:
    return asyncio.run(prepare(preparer, ResponsesRequest(**kw)))


_chat = prepare_chat


def test_a_tool_round_trip_prepares_what_the_same_chat_request_does(preparer: Preparer) -> None:
    items = [
        {"role": "user", "content": [{"type": "input_text", "text": "Weather?"}]},
        # An earlier response's output items, as the client got them: text, then a call.
        {
            "type": "message",
            "id": "msg_1",
            "role": "assistant",
            "status": "completed",
            "content": [{"type": "output_text", "text": "Checking.", "annotations": []}],
        },
        {"type": "function_call", "call_id": "call_1", "name": "weather", "arguments": ARGS},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
    ]
    resp = _responses(
        preparer,
        input=items,
        instructions="Be brief.",
        tools=TOOLS,
        tool_choice={"type": "function", "name": "weather"},
        max_output_tokens=20,
        temperature=0.5,
        top_p=0.9,
        seed=3,
    )
    call = {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": ARGS}}
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "Checking.", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    chat = _chat(
        preparer,
        messages=messages,
        tools=CHAT_TOOLS,
        tool_choice={"type": "function", "function": {"name": "weather"}},
        max_tokens=20,
        temperature=0.5,
        top_p=0.9,
        seed=3,
    )
    assert resp.inputs == chat.inputs and resp.params == chat.params
    assert resp.tool_use == chat.tool_use and resp.constraint == chat.constraint
    # A plain string input is one user message.
    plain = _responses(preparer, input="Weather?", max_output_tokens=4)
    chat_plain = _chat(preparer, messages=[{"role": "user", "content": "Weather?"}], max_tokens=4)
    assert plain.inputs == chat_plain.inputs and plain.constraint is None


@pytest.mark.parametrize(
    ("fmt", "response_format"),
    [
        ({"type": "json_object"}, {"type": "json_object"}),
        (
            {"type": "json_schema", "name": "w", "schema": WEATHER, "strict": True},
            {"type": "json_schema", "json_schema": {"name": "w", "schema": WEATHER}},
        ),
    ],
)
def test_text_format_is_chats_response_format(
    preparer: Preparer, fmt: dict[str, Any], response_format: dict[str, Any]
) -> None:
    resp = _responses(preparer, input="Hi", text={"format": fmt})
    chat = _chat(
        preparer, messages=[{"role": "user", "content": "Hi"}], response_format=response_format
    )
    assert resp.constraint is not None and chat.constraint is not None
    assert resp.params.structured_outputs == chat.params.structured_outputs
    # Echoed back as openai's model has it.
    echoed = Response.model_validate(_formatter(preparer, text={"format": fmt}).body("queued", []))
    assert echoed.text is not None and echoed.text.format is not None
    assert echoed.text.format.type == fmt["type"]


def test_neutral_values_of_unsupported_fields_are_accepted(preparer: Preparer) -> None:
    prepared = _responses(
        preparer,
        input="Hi",
        store=True,
        truncation="disabled",
        include=[],
        background=False,
        reasoning=None,
        service_tier="auto",
        user="u1",
        metadata={"k": "v"},
        text={"format": {"type": "text"}},
    )
    assert prepared.constraint is None and prepared.tool_use is None


@pytest.mark.parametrize(
    ("kw", "param"),
    [
        ({"previous_response_id": "resp_1"}, "previous_response_id"),
        ({"reasoning": {"effort": "low"}}, "reasoning"),
        ({"include": ["message.output_text.logprobs"]}, "include"),
        ({"truncation": "auto"}, "truncation"),
        ({"background": True}, "background"),
        ({"conversation": "conv_1"}, "conversation"),
        ({"frequency_penalty": 0.5}, "frequency_penalty"),  # a chat field, not a Responses one
        ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"tools": [{**TOOLS[0], "defer_loading": True}]}, "tools[0].defer_loading"),
        ({"tools": [{**TOOLS[0], "name": "bad name"}]}, "tools[0].name"),
        ({"tools": [TOOLS[0], TOOLS[0]]}, "tools[1].name"),
        (
            {"tools": [{**TOOLS[0], "parameters": {"type": "object", "properties": {"a": 1}}}]},
            "tools[0].parameters",
        ),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice.name"),
        ({"tools": TOOLS, "tool_choice": {"type": "web_search"}}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"text": {"format": {"type": "xml"}}}, "text.format.type"),
        ({"text": {"format": {"type": "json_schema", "schema": WEATHER}}}, "text.format.name"),
        (
            {"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nope"}}}},
            "text.format.schema",
        ),
        ({"text": {"verbosity": "low"}}, "text.verbosity"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"max_output_tokens": 5000}, "max_output_tokens"),  # past the context
        ({"temperature": -1.0}, "temperature"),
        ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
        ({"input": []}, "input"),
        ({"input": ["hi"]}, "input[0]"),
        ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            "input[0].content[0].type",
        ),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type"),
        # Reasoning items are dropped (as templates drop earlier thinking): alone, nothing is left.
        ({"input": [{"type": "reasoning", "summary": []}]}, "input"),
        ({"input": [{"type": "function_call_output", "output": "x"}]}, "input[0].call_id"),
        (
            {"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": {}}]},
            "input[0].arguments",
        ),
    ],
)
def test_bad_and_unsupported_fields_are_400s_naming_them(
    preparer: Preparer, kw: dict[str, Any], param: str
) -> None:
    body = {"input": "Hi", **kw}
    with pytest.raises(InvalidRequestError) as err:
        _responses(preparer, **body)
    assert err.value.param == param, err.value.message
    assert err.value.message.startswith(param.split("[")[0]), err.value.message


# -- the formatter -----------------------------------------------------------------------------


def _outputs(
    pieces: list[str], finish: str, prompt_tokens: int = 5, cached: int = 0
) -> list[RequestOutput]:
    """The DELTA outputs of an engine request whose text arrives in `pieces` (the last
    output carries the cumulative text and token ids, as the engine's does)."""
    outs = []
    for i, piece in enumerate(pieces):
        last = i == len(pieces) - 1
        c = CompletionOutput(
            0,
            text="".join(pieces) if last else "",
            token_ids=list(range(len(pieces))) if last else [],
            finish_reason=finish if last else None,
            delta_text=piece,
        )
        outs.append(
            RequestOutput(
                "r", None, list(range(prompt_tokens)), [c], last, num_cached_tokens=cached
            )
        )
    return outs


def _formatter(preparer: Preparer, **kw: Any) -> ResponsesFormatter:
    body = ResponsesRequest(input="Hi", **kw)
    prepared = asyncio.run(prepare(preparer, body))
    return ResponsesFormatter(body.echo(prepared.tool_use), "kvray-demo", prepared.tool_use)


def _events(frames: list[str]) -> list[dict[str, Any]]:
    """Each SSE frame's event, checked against its `event:` line and openai's event models."""
    out = []
    for frame in "".join(frames).removesuffix("\n\n").split("\n\n"):
        head, data = frame.split("\n")
        event = json.loads(data.removeprefix("data: "))
        assert head == f"event: {event['type']}"
        EVENTS.validate_python(event)
        out.append(event)
    return out


def _stream(fmt: ResponsesFormatter, outs: list[RequestOutput]) -> list[dict[str, Any]]:
    frames = fmt.start()
    for out in outs:
        frames += fmt.chunks(out)
    return _events(frames)


def _shape(output: list[dict[str, Any]]) -> list[tuple[Any, ...]]:
    """Items without their generated ids."""
    return [
        (i["type"], i["status"], i.get("name"), i.get("arguments"), i.get("content"))
        for i in output
    ]


def test_text_streams_as_openais_event_sequence(preparer: Preparer) -> None:
    fmt = _formatter(preparer, metadata={"k": "v"}, instructions="Be brief.")
    events = _stream(fmt, _outputs(["Hel", "", "lo"], "stop", cached=2))
    assert [e["type"] for e in events] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [e["delta"] for e in events if e["type"] == "response.output_text.delta"] == [
        "Hel",
        "lo",
    ]
    item_ids = {e["item_id"] for e in events if "item_id" in e}
    assert len(item_ids) == 1 and next(iter(item_ids)).startswith("msg_")
    final = Response.model_validate(events[-1]["response"])
    assert final.status == "completed" and final.output_text == "Hello"
    assert final.id == fmt.id and final.id.startswith("resp_")
    assert final.metadata == {"k": "v"} and final.instructions == "Be brief."
    assert final.usage is not None and final.usage.input_tokens == 5
    assert final.usage.output_tokens == 3 and final.usage.total_tokens == 8
    assert final.usage.input_tokens_details.cached_tokens == 2
    # The same output as one object: the same items.
    whole = _formatter(preparer).response(_outputs(["Hel", "", "lo"], "stop")[-1:])
    Response.model_validate(whole)
    assert _shape(whole["output"]) == _shape(events[-1]["response"]["output"])


def test_max_output_tokens_ends_incomplete(preparer: Preparer) -> None:
    events = _stream(_formatter(preparer, max_output_tokens=2), _outputs(["a", "b"], "length"))
    final = Response.model_validate(events[-1]["response"])
    assert events[-1]["type"] == "response.incomplete"
    assert final.status == "incomplete" and final.incomplete_details is not None
    assert final.incomplete_details.reason == "max_output_tokens"
    assert final.max_output_tokens == 2 and final.output[0].status == "incomplete"


def test_calls_are_function_call_items_streamed_or_not(preparer: Preparer) -> None:
    # tool_choice auto: the model writes text, then a <tool_call> block, then more text.
    text = f'Checking.\n<tool_call>\n{{"name": "weather", "arguments": {ARGS}}}\n</tool_call>\nOk'
    pieces = [text[i : i + 7] for i in range(0, len(text), 7)]
    fmt = _formatter(preparer, tools=TOOLS)
    events = _stream(fmt, _outputs(pieces, "stop"))
    final = events[-1]["response"]
    Response.model_validate(final)
    assert [(i["type"], i.get("name")) for i in final["output"]] == [
        ("message", None),
        ("function_call", "weather"),
        ("message", None),
    ]
    call = final["output"][1]
    assert json.loads(call["arguments"]) == {"city": "Paris"}
    assert call["id"].startswith("fc_") and call["call_id"].startswith("call_")
    kinds = [e["type"] for e in events if e.get("output_index") == 1]
    assert kinds == [
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
    ]
    assert [e["output_index"] for e in events if e["type"] == "response.output_item.added"] == [
        0,
        1,
        2,
    ]
    whole = _formatter(preparer, tools=TOOLS).response(_outputs([text], "stop"))
    assert _shape(whole["output"]) == _shape(final["output"])
    assert whole["tools"][0]["name"] == "weather" and whole["tool_choice"] == "auto"


def test_a_forced_call_is_the_only_item(preparer: Preparer) -> None:
    fmt = _formatter(preparer, tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
    # Held to the deployment's format (hermes here): a <tool_call> block.
    out = _outputs([f'<tool_call>\n{{"name":"weather","arguments":{ARGS}}}\n</tool_call>'], "stop")
    whole = Response.model_validate(fmt.response(out))
    assert [i.type for i in whole.output] == ["function_call"]
    assert whole.tool_choice == "required" and whole.parallel_tool_calls is False


def test_a_failure_mid_stream_is_an_error_event(preparer: Preparer) -> None:
    fmt = _formatter(preparer)
    outs = _outputs(["a", "b", "c"], "stop")
    closed: list[bool] = []

    async def engine() -> AsyncIterator[RequestOutput]:
        try:
            yield outs[1]
            raise QueueTimeoutError("the replica went away")
        finally:
            closed.append(True)

    async def read() -> list[str]:
        stream = engine()
        return [f async for f in sse_events(fmt, [stream], [outs[0]])]

    events = _events(asyncio.run(read()))
    assert events[-1]["type"] == "error" and events[-1]["message"] == "the replica went away"
    assert events[-1]["code"] == "service_unavailable"
    assert [e["type"] for e in events].count("response.output_text.delta") == 2
    assert closed == [True] and fmt.finished

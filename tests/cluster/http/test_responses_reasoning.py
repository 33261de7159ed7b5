"""/v1/responses with a reasoning model (no server): the thinking as a `reasoning` item before
the answer, streamed as openai's reasoning_text events; `chat_template_kwargs`; reasoning
items sent back in `input`."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from openai.types.responses import Response

from cluster.errors import InvalidRequestError
from cluster.http.responses import ResponsesRequest, prepare
from cluster.http.responses_format import ResponsesFormatter
from cluster.ingress.limits import DEFAULT_LIMITS
from cluster.ingress.output_parsing import Reasoning
from cluster.ingress.prepare import Preparer
from tests.cluster.http.demo_preparer import demo_preparer
from tests.cluster.http.test_responses import ARGS, TOOLS, _outputs, _shape, _stream

QWEN3 = Reasoning("qwen3", inside=False, may_open=True)
R1 = Reasoning("deepseek_r1", inside=True)
THOUGHT = "<think>\nTwo and two.\n</think>\n\nFour."


@pytest.fixture(scope="module")
def preparer() -> Preparer:
    return demo_preparer()


def _formatter(
    preparer: Preparer, reasoning: Reasoning | None, tools: bool = False
) -> ResponsesFormatter:
    body = ResponsesRequest(input="Hi", tools=TOOLS if tools else None)
    use = asyncio.run(prepare(preparer, body)).tool_use
    return ResponsesFormatter(body.echo(use), "kvray-demo", use, reasoning)


def _pieces(text: str, size: int) -> list[str]:
    return [text[i : i + size] for i in range(0, len(text), size)]


@pytest.mark.parametrize("size", [1, 4, 1000])
def test_the_reasoning_is_an_item_before_the_message(preparer: Preparer, size: int) -> None:
    events = _stream(_formatter(preparer, QWEN3), _outputs(_pieces(THOUGHT, size), "stop"))
    final = Response.model_validate(events[-1]["response"])
    assert [i.type for i in final.output] == ["reasoning", "message"]
    item = final.output[0]
    assert item.type == "reasoning" and item.id.startswith("rs_") and item.summary == []
    assert item.status == "completed"
    assert [(c.type, c.text) for c in item.content or []] == [("reasoning_text", "Two and two.")]
    assert final.output_text == "Four."
    # The reasoning item's events, then the message's, each item opened and closed in turn.
    kinds = [e["type"] for e in events if e.get("output_index") == 0]
    assert kinds[:2] == ["response.output_item.added", "response.content_part.added"]
    assert set(kinds[2:-3]) == {"response.reasoning_text.delta"}
    assert kinds[-3:] == [
        "response.reasoning_text.done",
        "response.content_part.done",
        "response.output_item.done",
    ]
    deltas = [e["delta"] for e in events if e["type"] == "response.reasoning_text.delta"]
    assert "".join(deltas) == "Two and two."
    done = [e for e in events if e["type"] == "response.output_item.done"]
    assert [e["output_index"] for e in done] == [0, 1]
    first_message_event = next(i for i, e in enumerate(events) if e.get("output_index") == 1)
    assert first_message_event > events.index(done[0])
    # The same output as one object: the same items.
    whole = _formatter(preparer, QWEN3).response(_outputs([THOUGHT], "stop"))
    Response.model_validate(whole)
    assert _shape(whole["output"]) == _shape(events[-1]["response"]["output"])


def test_cut_off_while_thinking_is_the_reasoning_item_alone(preparer: Preparer) -> None:
    events = _stream(_formatter(preparer, R1), _outputs(["Two and", " two"], "length"))
    final = Response.model_validate(events[-1]["response"])
    assert events[-1]["type"] == "response.incomplete"
    assert [(i.type, i.status) for i in final.output] == [("reasoning", "incomplete")]
    assert final.output_text == ""


def test_without_a_parser_the_thinking_stays_in_the_text(preparer: Preparer) -> None:
    whole = Response.model_validate(
        _formatter(preparer, None).response(_outputs([THOUGHT], "stop"))
    )
    assert [i.type for i in whole.output] == ["message"] and whole.output_text == THOUGHT


def test_calls_after_the_reasoning_are_function_call_items(preparer: Preparer) -> None:
    text = f'<think>Use the tool.</think>\n<tool_call>{{"name": "weather", "arguments": {ARGS}}}'
    text += "</tool_call>"
    events = _stream(_formatter(preparer, QWEN3, tools=True), _outputs(_pieces(text, 3), "stop"))
    final = Response.model_validate(events[-1]["response"])
    assert [i.type for i in final.output] == ["reasoning", "function_call"]
    whole = _formatter(preparer, QWEN3, tools=True).response(_outputs([text], "stop"))
    assert _shape(whole["output"]) == _shape(events[-1]["response"]["output"])


def test_chat_template_kwargs_reach_the_template(preparer: Preparer) -> None:
    body = ResponsesRequest(input="Hi", chat_template_kwargs={"enable_thinking": False})
    assert body.prompt_input(DEFAULT_LIMITS).template_kwargs == {"enable_thinking": False}
    asyncio.run(prepare(preparer, body))  # the demo template ignores it
    with pytest.raises(InvalidRequestError) as err:
        asyncio.run(
            prepare(preparer, ResponsesRequest(input="Hi", chat_template_kwargs={"tools": 1}))
        )
    assert err.value.param == "chat_template_kwargs"


def test_reasoning_items_sent_back_are_dropped(preparer: Preparer) -> None:
    turn: list[Any] = [{"role": "user", "content": "Two and two?"}]
    back = [
        {
            "type": "reasoning",
            "id": "rs_1",
            "summary": [],
            "content": [{"type": "reasoning_text", "text": "Two and two."}],
        },
        {
            "type": "message",
            "role": "assistant",
            "content": [{"type": "output_text", "text": "Four.", "annotations": []}],
        },
        {"role": "user", "content": "And three?"},
    ]
    with_item = asyncio.run(prepare(preparer, ResponsesRequest(input=turn + back)))
    without = asyncio.run(prepare(preparer, ResponsesRequest(input=turn + back[1:])))
    assert with_item.inputs[0].prompt_token_ids == without.inputs[0].prompt_token_ids

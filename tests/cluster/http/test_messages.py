"""/v1/messages' request without Ray: a Messages request prepares the engine input the
equivalent chat request does (template, tools, constraint, sampling), count_tokens counts that
prompt, and bad fields are 400s naming them as Anthropic's API spells them."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from pydantic import ValidationError

from cluster.errors import InvalidRequestError
from cluster.http.messages import CountTokensRequest, MessagesRequest, count_tokens, prepare
from cluster.ingress.prepare import Prepared, Preparer
from tests.cluster.http.demo_preparer import demo_preparer, prepare_chat

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
    "required": ["city"],
    "additionalProperties": False,
}
TOOLS = [{"name": "weather", "description": "Forecast", "input_schema": WEATHER}]
CHAT_TOOLS = [
    {
        "type": "function",
        "function": {"name": "weather", "description": "Forecast", "parameters": WEATHER},
    }
]


@pytest.fixture(scope="module")
def preparer() -> Preparer:
    return demo_preparer()


def _messages(preparer: Preparer, **kw: Any) -> Prepared:
    return asyncio.run(prepare(preparer, MessagesRequest(**kw)))


_chat = prepare_chat


def test_a_tool_round_trip_prepares_what_the_same_chat_request_does(preparer: Preparer) -> None:
    anthropic = _messages(
        preparer,
        system="Be brief.",
        max_tokens=7,
        temperature=0.5,
        top_p=0.9,
        top_k=4,
        stop_sequences=["\n\n"],
        tools=TOOLS,
        tool_choice={"type": "any"},
        metadata={"user_id": "u1"},
        messages=[
            {"role": "user", "content": "Weather in Paris?"},
            {
                "role": "assistant",
                "content": [
                    {
                        "type": "tool_use",
                        "id": "toolu_1",
                        "name": "weather",
                        "input": {"city": "Paris"},
                    }
                ],
            },
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"}],
            },
        ],
    )
    chat = _chat(
        preparer,
        max_tokens=7,
        temperature=0.5,
        top_p=0.9,
        top_k=4,
        stop=["\n\n"],
        tools=CHAT_TOOLS,
        tool_choice="required",
        messages=[
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Weather in Paris?"},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {
                        "id": "toolu_1",
                        "type": "function",
                        "function": {"name": "weather", "arguments": '{"city": "Paris"}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "toolu_1", "name": "weather", "content": "sunny"},
        ],
    )
    assert anthropic.inputs[0].prompt_token_ids == chat.inputs[0].prompt_token_ids
    assert anthropic.params == chat.params
    assert anthropic.tool_use == chat.tool_use


def test_count_tokens_counts_the_prompt_the_message_would_run(preparer: Preparer) -> None:
    kw: dict[str, Any] = {"messages": [{"role": "user", "content": "Hi"}], "tools": TOOLS}
    prepared = _messages(preparer, max_tokens=4, **kw)
    counted = asyncio.run(count_tokens(preparer, CountTokensRequest(**kw)))
    assert counted == len(prepared.inputs[0].prompt_token_ids)
    without_tools = asyncio.run(count_tokens(preparer, CountTokensRequest(messages=kw["messages"])))
    assert 0 < without_tools < counted


def test_max_tokens_is_required() -> None:
    with pytest.raises(ValidationError) as err:
        MessagesRequest(messages=[{"role": "user", "content": "Hi"}])
    assert err.value.errors()[0]["loc"] == ("max_tokens",)


@pytest.mark.parametrize(
    ("kw", "field"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -1.0}, "temperature"),
        ({"top_k": -5}, "top_k"),
        ({"stop_sequences": [""]}, "stop_sequences"),
        (
            {"tools": [{"name": "f", "input_schema": {"type": "object", "properties": 3}}]},
            "tools.0.input_schema",
        ),
        ({"messages": [{"role": "tool", "content": "x"}]}, "messages.0.role"),
        ({"thinking": "on"}, "thinking"),
        ({"thinking": {"type": "enabled"}}, "thinking.budget_tokens"),
        ({"thinking": {"type": "sometimes"}}, "thinking.type"),
    ],
)
def test_bad_fields_are_400s_naming_them(
    preparer: Preparer, kw: dict[str, Any], field: str
) -> None:
    body: dict[str, Any] = {"max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}]}
    with pytest.raises(InvalidRequestError) as err:
        _messages(preparer, **(body | kw))
    assert err.value.param == field
    assert field in err.value.message


def test_thinking_is_the_templates_enable_thinking(preparer: Preparer) -> None:
    base: dict[str, Any] = {"max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}]}
    for thinking, enabled in [
        ({"type": "enabled", "budget_tokens": 2048}, True),  # the budget is not enforced
        ({"type": "adaptive"}, True),
        ({"type": "disabled"}, False),
    ]:
        body = MessagesRequest(**base, thinking=thinking)
        assert body.prompt_input(preparer.limits).template_kwargs == {"enable_thinking": enabled}
        _messages(preparer, **base, thinking=thinking)  # the demo template ignores it
    assert MessagesRequest(**base).prompt_input(preparer.limits).template_kwargs is None
    # count_tokens renders the prompt the same way.
    counted = CountTokensRequest(messages=base["messages"], thinking={"type": "disabled"})
    assert counted.prompt_input(preparer.limits).template_kwargs == {"enable_thinking": False}

"""Anthropic Messages content into chat template messages and chat's ToolUse, without Ray:
the blocks of each turn, tools and tool_choice, and a 400 naming the block or field for
anything kvray does not serve."""

from __future__ import annotations

from typing import Any

import pytest

from cluster.errors import InvalidRequestError
from cluster.http.messages_input import template_messages, thinking_kwargs, tool_input, tool_use

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [{"name": "weather", "description": "Forecast", "input_schema": WEATHER}]


def test_strings_and_text_blocks_are_chat_messages() -> None:
    msgs = [
        {"role": "user", "content": "Hi"},
        {
            "role": "assistant",
            "content": [{"type": "text", "text": "Hel"}, {"type": "text", "text": "lo"}],
        },
        {
            "role": "user",
            "content": [{"type": "text", "text": "Bye", "cache_control": {"type": "ephemeral"}}],
        },
    ]
    system = [{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}]
    assert template_messages(system, msgs) == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello"},
        {"role": "user", "content": "Bye"},
    ]
    assert template_messages("S", msgs[:1])[0] == {"role": "system", "content": "S"}
    assert template_messages(None, msgs[:1]) == [{"role": "user", "content": "Hi"}]


def test_a_tool_round_trip_is_chats_tool_calls_and_tool_messages() -> None:
    msgs = [
        {"role": "user", "content": "Weather?"},
        {
            "role": "assistant",
            "content": [
                {"type": "thinking", "thinking": "hm", "signature": "x"},
                {"type": "text", "text": "Let me look."},
                {"type": "tool_use", "id": "toolu_1", "name": "weather", "input": {"city": "Rome"}},
            ],
        },
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"},
                {
                    "type": "tool_result",
                    "tool_use_id": "toolu_2",
                    "content": [{"type": "text", "text": "down"}],
                    "is_error": True,
                },
                {"type": "text", "text": "And tomorrow?"},
            ],
        },
    ]
    assert template_messages(None, msgs)[1:] == [
        {
            "role": "assistant",
            "content": "Let me look.",
            "tool_calls": [
                {
                    "id": "toolu_1",
                    "type": "function",
                    "function": {"name": "weather", "arguments": {"city": "Rome"}},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "toolu_1", "content": "sunny", "name": "weather"},
        {"role": "tool", "tool_call_id": "toolu_2", "content": "Error: down"},
        {"role": "user", "content": "And tomorrow?"},
    ]


@pytest.mark.parametrize(
    ("system", "messages", "field"),
    [
        (None, [], "messages"),
        (None, [{"role": "system", "content": "x"}], "messages.0.role"),
        (None, [{"role": "user", "content": 3}], "messages.0.content"),
        (
            None,
            [
                {"role": "user", "content": "x"},
                {"role": "user", "content": [{"type": "image", "source": {}}]},
            ],
            "messages.1.content.0.type",
        ),
        (
            None,
            [{"role": "assistant", "content": [{"type": "document"}]}],
            "messages.0.content.0.type",
        ),
        (None, [{"role": "user", "content": [{"text": "x"}]}], "messages.0.content.0.type"),
        (
            None,
            [{"role": "user", "content": [{"type": "tool_result"}]}],
            "messages.0.content.0.tool_use_id",
        ),
        (
            None,
            [
                {
                    "role": "assistant",
                    "content": [{"type": "tool_use", "id": "t", "name": "f", "input": []}],
                }
            ],
            "messages.0.content.0.input",
        ),
        ([{"type": "image"}], [{"role": "user", "content": "x"}], "system.0.type"),
        (5, [{"role": "user", "content": "x"}], "system"),
    ],
)
def test_bad_content_is_a_400_naming_the_block(system: Any, messages: Any, field: str) -> None:
    with pytest.raises(InvalidRequestError) as err:
        template_messages(system, messages)
    assert err.value.param == field
    assert err.value.message.startswith(f"{field}: ")


def test_an_image_is_refused_clearly() -> None:
    with pytest.raises(InvalidRequestError, match="unknown block type 'image'"):
        template_messages(None, [{"role": "user", "content": [{"type": "image"}]}])


@pytest.mark.parametrize(
    ("choice", "mode", "name", "parallel"),
    [
        (None, "auto", None, True),
        ({"type": "auto"}, "auto", None, True),
        ({"type": "any", "disable_parallel_tool_use": True}, "required", None, False),
        ({"type": "tool", "name": "weather"}, "named", "weather", True),
        ({"type": "none"}, "none", None, True),
    ],
)
def test_tool_choice_is_chats(choice: Any, mode: str, name: str | None, parallel: bool) -> None:
    use = tool_use(TOOLS, choice)
    assert use is not None and use.choice.mode == mode and use.choice.name == name
    assert use.parallel is parallel
    (tool,) = use.tools
    assert (tool.name, tool.description, dict(tool.parameters)) == ("weather", "Forecast", WEATHER)


def test_no_tools_is_no_tool_use() -> None:
    assert tool_use(None, None) is None
    assert tool_use([], {"type": "auto"}) is None


@pytest.mark.parametrize(
    ("tools", "choice", "field"),
    [
        ([{"type": "web_search_20250305", "name": "web_search"}], None, "tools.0.type"),
        ([{"name": "f"}], None, "tools.0.input_schema"),
        ([{"name": "f", "input_schema": {"type": "array"}}], None, "tools.0.input_schema"),
        ([{"name": "bad name", "input_schema": WEATHER}], None, "tools.0.name"),
        (TOOLS + TOOLS, None, "tools.1.name"),
        (TOOLS, {"type": "function"}, "tool_choice.type"),
        (TOOLS, "auto", "tool_choice.type"),
        (TOOLS, {"type": "tool"}, "tool_choice.name"),
        (TOOLS, {"type": "tool", "name": "clock"}, "tool_choice.name"),
        (None, {"type": "any"}, "tool_choice"),
    ],
)
def test_bad_tools_are_400s_naming_the_field(tools: Any, choice: Any, field: str) -> None:
    with pytest.raises(InvalidRequestError) as err:
        tool_use(tools, choice)
    assert err.value.param == field


def test_tool_input_is_the_arguments_object() -> None:
    assert tool_input('{"city": "Oslo"}') == {"city": "Oslo"}


@pytest.mark.parametrize(
    ("thinking", "kwargs"),
    [
        (None, None),
        ({"type": "enabled", "budget_tokens": 1024}, {"enable_thinking": True}),
        ({"type": "enabled", "budget_tokens": 1, "display": "omitted"}, {"enable_thinking": True}),
        ({"type": "adaptive"}, {"enable_thinking": True}),
        ({"type": "disabled"}, {"enable_thinking": False}),
    ],
)
def test_thinking_is_the_enable_thinking_template_variable(thinking: Any, kwargs: Any) -> None:
    assert thinking_kwargs(thinking) == kwargs


@pytest.mark.parametrize(
    ("thinking", "field"),
    [
        (True, "thinking"),
        ({}, "thinking.type"),
        ({"type": "enabled"}, "thinking.budget_tokens"),
        ({"type": "enabled", "budget_tokens": 0}, "thinking.budget_tokens"),
        ({"type": "enabled", "budget_tokens": True}, "thinking.budget_tokens"),
        ({"type": "adaptive", "display": "loud"}, "thinking.display"),
    ],
)
def test_bad_thinking_is_a_400_naming_it(thinking: Any, field: str) -> None:
    with pytest.raises(InvalidRequestError) as err:
        thinking_kwargs(thinking)
    assert err.value.param == field and err.value.message.startswith(f"{field}: ")

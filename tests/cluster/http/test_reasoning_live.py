"""Reasoning end to end: the official `openai` (chat, Responses) and `anthropic` clients
drive a tool-using conversation with the thinking apart from the answer, against the shared
app (tests/cluster/conftest.py: `--reasoning-parser qwen3`) and the demo model.

The demo template opens a `<think>` block when asked (`enable_thinking`), as reasoning
models' templates do. The demo model never closes it by itself, so each turn gives the
thinking a budget: the engine forces `</think>` after it, and the answer (here a tool call,
constrained once the thinking ends) follows."""

from __future__ import annotations

import json
from typing import Any

import anthropic
import jsonschema
import pytest

from tests.cluster.http.test_messages_live import MODEL, WEATHER
from tests.cluster.serve_helpers import App, openai_client

pytestmark = pytest.mark.slow

CHAT_TOOLS: list[Any] = [
    {"type": "function", "function": {"name": "weather", "parameters": WEATHER}}
]
ASK: list[Any] = [{"role": "user", "content": "Weather in Paris?"}]
BUDGET = 6
THINK = {"chat_template_kwargs": {"enable_thinking": True}, "thinking_token_budget": BUDGET}


def _reasoning(message: Any) -> str | None:
    return (message.model_extra or {}).get("reasoning_content")


def test_chat_thinks_calls_a_tool_and_answers(kvray_app: App) -> None:
    client = openai_client(kvray_app)
    ask: dict[str, Any] = dict(
        model=MODEL,
        messages=ASK,
        tools=CHAT_TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=100,
        temperature=0.0,
        extra_body=THINK,
    )
    first = client.chat.completions.create(**ask)
    choice = first.choices[0]
    thinking = _reasoning(choice.message)
    assert thinking and "<think>" not in thinking and "</think>" not in thinking
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    jsonschema.validate(json.loads(call.function.arguments), WEATHER)
    # The thinking is exactly the budget's tokens: those of the same prompt cut by max_tokens.
    cut = client.chat.completions.create(
        model=MODEL,
        messages=ASK,
        tools=CHAT_TOOLS,
        max_tokens=BUDGET,
        temperature=0.0,
        extra_body={"chat_template_kwargs": {"enable_thinking": True}},
    )
    assert cut.choices[0].finish_reason == "length"
    assert _reasoning(cut.choices[0].message) == thinking

    # Streamed: the thinking first, as reasoning_content deltas, then the call; the same.
    chunks = list(client.chat.completions.create(**ask, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    streamed = "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas)
    assert streamed == thinking
    first_call = next(i for i, d in enumerate(deltas) if d.tool_calls)
    assert all(not (d.model_extra or {}).get("reasoning_content") for d in deltas[first_call:])
    args = "".join(tc.function.arguments or "" for d in deltas for tc in d.tool_calls or [])
    assert json.loads(args) == json.loads(call.function.arguments)

    # The call and its result back: the model thinks again, then answers in text.
    second = client.chat.completions.create(
        model=MODEL,
        messages=[
            *ASK,
            {"role": "assistant", "tool_calls": [call.model_dump()]},
            {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21C"},
        ],
        tools=CHAT_TOOLS,
        max_tokens=24,
        temperature=0.0,
        extra_body=THINK,
    )
    assert _reasoning(second.choices[0].message)
    assert second.usage.prompt_tokens > first.usage.prompt_tokens


def test_without_thinking_the_answer_is_all_content(kvray_app: App) -> None:
    r = openai_client(kvray_app).chat.completions.create(
        model=MODEL, messages=ASK, max_tokens=6, temperature=0.0
    )
    assert _reasoning(r.choices[0].message) is None and r.choices[0].message.content


def test_a_budget_needs_a_thinking_prompt_to_matter(kvray_app: App) -> None:
    """Cut by max_tokens inside the thinking: all of it is thinking, and no answer."""
    r = openai_client(kvray_app).chat.completions.create(
        model=MODEL,
        messages=ASK,
        max_tokens=4,
        temperature=0.0,
        extra_body={"chat_template_kwargs": {"enable_thinking": True}},
    )
    assert _reasoning(r.choices[0].message) and r.choices[0].message.content is None
    assert r.choices[0].finish_reason == "length"


def test_responses_returns_a_reasoning_item_before_the_call(kvray_app: App) -> None:
    client = openai_client(kvray_app)
    tools: Any = [{"type": "function", "name": "weather", "parameters": WEATHER}]
    r = client.responses.create(
        model=MODEL,
        input=ASK,
        tools=tools,
        tool_choice="required",
        parallel_tool_calls=False,
        max_output_tokens=100,
        temperature=0.0,
        extra_body=THINK,
    )
    assert [i.type for i in r.output] == ["reasoning", "function_call"]
    assert r.output[0].content and r.output[0].content[0].text
    jsonschema.validate(json.loads(r.output[1].arguments), WEATHER)
    # Streamed: the reasoning's events first, the same text; then the call.
    with client.responses.stream(
        model=MODEL,
        input=ASK,
        tools=tools,
        tool_choice="required",
        parallel_tool_calls=False,
        max_output_tokens=100,
        temperature=0.0,
        extra_body=THINK,
    ) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_response()
    first_call = kinds.index("response.function_call_arguments.delta")
    assert "response.reasoning_text.delta" in kinds[:first_call]
    assert final.output[0].content[0].text == r.output[0].content[0].text
    # The reasoning and the call sent back (reasoning items are dropped from the prompt),
    # with the call's output: the model thinks again, then answers.
    second = client.responses.create(
        model=MODEL,
        input=[
            *ASK,
            *[item.model_dump(exclude_none=True) for item in r.output],
            {"type": "function_call_output", "call_id": r.output[1].call_id, "output": "sunny"},
        ],
        tools=tools,
        max_output_tokens=24,
        temperature=0.0,
        extra_body=THINK,
    )
    assert second.output[0].type == "reasoning"


def test_messages_thinks_in_a_thinking_block_then_uses_the_tool(kvray_app: App) -> None:
    client = anthropic.Anthropic(
        base_url=kvray_app.base_url, api_key=kvray_app.api_key, max_retries=0, timeout=120
    )
    tools: Any = [{"name": "weather", "description": "Forecast", "input_schema": WEATHER}]
    ask: dict[str, Any] = dict(
        model=MODEL,
        messages=ASK,
        tools=tools,
        tool_choice={"type": "any", "disable_parallel_tool_use": True},
        max_tokens=100,
        thinking={"type": "enabled", "budget_tokens": BUDGET},
        extra_body={"temperature": 0.0},
    )
    first = client.messages.create(**ask)
    assert [b.type for b in first.content] == ["thinking", "tool_use"]
    assert first.stop_reason == "tool_use" and first.content[0].thinking
    jsonschema.validate(first.content[1].input, WEATHER)
    with client.messages.stream(**ask) as stream:
        kinds = [(e.type, getattr(getattr(e, "delta", None), "type", None)) for e in stream]
        final = stream.get_final_message()
    assert ("content_block_delta", "thinking_delta") in kinds
    assert ("content_block_delta", "input_json_delta") in kinds
    assert final.content[0].thinking == first.content[0].thinking
    result: Any = {"type": "tool_result", "tool_use_id": first.content[1].id, "content": "sunny"}
    second = client.messages.create(
        model=MODEL,
        messages=[*ASK, first.to_param(), {"role": "user", "content": [result]}],
        tools=tools,
        max_tokens=24,
        thinking={"type": "enabled", "budget_tokens": BUDGET},
        extra_body={"temperature": 0.0},
    )
    assert second.content and second.content[0].type == "thinking"


def test_bad_reasoning_fields_are_each_apis_400_naming_them(kvray_app: App) -> None:
    import openai

    client = openai_client(kvray_app)
    for extra, field in [
        ({"thinking_token_budget": -1}, "thinking_token_budget"),
        ({"chat_template_kwargs": {"add_generation_prompt": False}}, "chat_template_kwargs"),
        ({"chat_template_kwargs": ["enable_thinking"]}, "chat_template_kwargs"),
    ]:
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(
                model=MODEL, messages=ASK, max_tokens=2, extra_body=extra
            )
        assert err.value.body["param"] == field, err.value.body  # type: ignore[index]
    claude = anthropic.Anthropic(
        base_url=kvray_app.base_url, api_key=kvray_app.api_key, max_retries=0, timeout=120
    )
    with pytest.raises(anthropic.BadRequestError) as bad:
        claude.messages.create(
            model=MODEL,
            messages=ASK,
            max_tokens=2,
            thinking={"type": "enabled"},  # type: ignore[typeddict-item]
        )
    error = bad.value.body["error"]  # type: ignore[index]
    assert error["type"] == "invalid_request_error" and "thinking" in error["message"]

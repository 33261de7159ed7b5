"""POST /v1/messages end to end: the official `anthropic` client against the shared app
(tests/cluster/conftest.py) and the demo model. Greedy text is compared with the chat
completion of the same conversation; a forced tool call is constrained, so its input is
checked; errors come in Anthropic's shape with the field named."""

from __future__ import annotations

from typing import Any

import anthropic
import httpx
import jsonschema
import pytest

from tests.cluster.serve_helpers import App, openai_client

pytestmark = pytest.mark.slow

MODEL = "kvray-demo"
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]}},
    "required": ["city"],
    "additionalProperties": False,
}
TOOLS: list[Any] = [{"name": "weather", "description": "Forecast", "input_schema": WEATHER}]
SYSTEM = "Be brief."
ASK = [{"role": "user", "content": "Say hello."}]
# Greedy. This SDK's create() has no sampling arguments (newer Claude models take none);
# older clients send them in the body, and kvray reads them there.
GREEDY = {"temperature": 0.0}


@pytest.fixture(scope="module")
def client(kvray_app: App) -> anthropic.Anthropic:
    # The SDK appends /v1/messages to the base URL.
    return anthropic.Anthropic(
        base_url=kvray_app.base_url, api_key=kvray_app.api_key, max_retries=0, timeout=120
    )


def test_a_message_is_the_chat_completions_answer(
    client: anthropic.Anthropic, kvray_app: App
) -> None:
    msg = client.messages.create(
        model=MODEL,
        system=SYSTEM,
        messages=ASK,  # type: ignore[arg-type]
        max_tokens=8,
        extra_body=GREEDY,
    )
    chat = openai_client(kvray_app).chat.completions.create(
        model=MODEL,
        messages=[{"role": "system", "content": SYSTEM}, *ASK],  # type: ignore[list-item]
        max_tokens=8,
        temperature=0.0,
    )
    assert msg.id.startswith("msg_") and msg.role == "assistant" and msg.model == MODEL
    text = "".join(b.text for b in msg.content if b.type == "text")
    assert text == chat.choices[0].message.content
    assert chat.usage is not None
    assert msg.usage.input_tokens == chat.usage.prompt_tokens
    assert msg.usage.output_tokens == chat.usage.completion_tokens
    reason = {"stop": "end_turn", "length": "max_tokens"}[chat.choices[0].finish_reason]
    assert msg.stop_reason == reason
    counted = client.messages.count_tokens(model=MODEL, system=SYSTEM, messages=ASK)  # type: ignore[arg-type]
    assert counted.input_tokens == msg.usage.input_tokens

    # Streamed: Anthropic's events in order, the same text and usage.
    with client.messages.stream(
        model=MODEL,
        system=SYSTEM,
        messages=ASK,  # type: ignore[arg-type]
        max_tokens=8,
        extra_body=GREEDY,
    ) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    assert "".join(b.text for b in final.content if b.type == "text") == text
    assert (final.stop_reason, final.usage.output_tokens) == (
        msg.stop_reason,
        msg.usage.output_tokens,
    )


def test_a_forced_tool_call_and_its_result_round_trip(client: anthropic.Anthropic) -> None:
    user: Any = {"role": "user", "content": "Weather in Paris?"}
    first = client.messages.create(
        model=MODEL,
        messages=[user],
        tools=TOOLS,
        tool_choice={"type": "tool", "name": "weather"},
        max_tokens=40,
    )
    assert first.stop_reason == "tool_use"
    (call,) = [b for b in first.content if b.type == "tool_use"]
    assert call.name == "weather" and call.id.startswith("toolu_")
    jsonschema.validate(call.input, WEATHER)
    result: Any = {"type": "tool_result", "tool_use_id": call.id, "content": "sunny, 21C"}
    second = client.messages.create(
        model=MODEL,
        messages=[user, first.to_param(), {"role": "user", "content": [result]}],
        tools=TOOLS,
        tool_choice={"type": "none"},
        max_tokens=6,
    )
    assert second.stop_reason in ("end_turn", "max_tokens")
    assert [b.type for b in second.content] in (["text"], [])


def test_keys_and_bad_input_are_anthropic_errors(
    client: anthropic.Anthropic, kvray_app: App
) -> None:
    wrong = anthropic.Anthropic(base_url=kvray_app.base_url, api_key="nope", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as auth:
        wrong.messages.create(model=MODEL, messages=ASK, max_tokens=2)  # type: ignore[arg-type]
    assert auth.value.body["error"]["type"] == "authentication_error"  # type: ignore[index]
    cases: list[tuple[dict[str, Any], str]] = [
        ({"messages": ASK}, "max_tokens"),
        (
            {
                "max_tokens": 2,
                "messages": [
                    *ASK,
                    {"role": "assistant", "content": "x"},
                    {
                        "role": "user",
                        "content": [
                            {"type": "image", "source": {"type": "url", "url": "http://x"}}
                        ],
                    },
                ],
            },
            "messages.2.content.0.type",
        ),
        ({"max_tokens": 2, "messages": [{"role": "tool", "content": "x"}]}, "messages.0.role"),
    ]
    for body, field in cases:
        resp = httpx.post(
            f"{kvray_app.base_url}/v1/messages",
            json={"model": MODEL, **body},
            headers={"x-api-key": str(kvray_app.api_key), "anthropic-version": "2023-06-01"},
            timeout=60,
        )
        assert resp.status_code == 400, resp.text
        err = resp.json()
        assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error"
        assert err["error"]["message"].startswith(field), err

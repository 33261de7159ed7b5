"""POST /v1/responses end to end: the official `openai` client against the shared app
(tests/cluster/conftest.py) and the demo model. Its unconstrained text is near-random, so
the tests check shapes and counts; forced tool calls and json_schema text are constrained,
so their content is checked too."""

from __future__ import annotations

import json
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from openai.types.responses import Response

from tests.cluster.serve_helpers import App, openai_client

pytestmark = pytest.mark.slow

MODEL = "kvray-demo"
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]}},
    "required": ["city"],
    "additionalProperties": False,
}
TOOLS: list[Any] = [
    {"type": "function", "name": "weather", "description": "Forecast", "parameters": WEATHER},
    {"type": "function", "name": "clock", "parameters": {"type": "object", "properties": {}}},
]
POINT = {
    "type": "object",
    "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["x"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def client(kvray_app: App) -> openai.OpenAI:
    return openai_client(kvray_app)


def test_create_answers_a_response_object(client: openai.OpenAI, kvray_app: App) -> None:
    resp = client.responses.create(
        model=MODEL,
        input="Say hello.",
        instructions="Be brief.",
        max_output_tokens=6,
        temperature=0.0,
        metadata={"run": "1"},
        store=False,
    )
    assert resp.id.startswith("resp_") and resp.object == "response" and resp.model == MODEL
    assert resp.status in ("completed", "incomplete")
    if resp.status == "incomplete":
        assert resp.incomplete_details is not None
        assert resp.incomplete_details.reason == "max_output_tokens"
    (item,) = resp.output
    assert item.type == "message" and item.role == "assistant" and item.id.startswith("msg_")
    assert isinstance(resp.output_text, str)
    assert resp.usage is not None and 0 < resp.usage.output_tokens <= 6
    assert resp.usage.total_tokens == resp.usage.input_tokens + resp.usage.output_tokens
    assert resp.instructions == "Be brief." and resp.metadata == {"run": "1"}
    assert resp.max_output_tokens == 6 and resp.temperature == 0.0
    # The raw body passes openai's model strictly (every required field present).
    raw = httpx.post(
        f"{kvray_app.base_url}/v1/responses",
        json={"model": MODEL, "input": "Hi", "max_output_tokens": 2},
        headers={"Authorization": f"Bearer {kvray_app.api_key}"},
        timeout=60,
    )
    assert raw.status_code == 200, raw.text
    Response.model_validate(raw.json())


def test_a_forced_call_and_its_result_round_trip(client: openai.OpenAI) -> None:
    user = {"role": "user", "content": "Weather in Paris?"}
    first = client.responses.create(
        model=MODEL,
        input=[user],
        tools=TOOLS,
        tool_choice={"type": "function", "name": "weather"},
        max_output_tokens=60,
        temperature=0.0,
    )
    assert first.status == "completed"
    (call,) = first.output
    assert call.type == "function_call" and call.name == "weather"
    assert call.call_id.startswith("call_") and call.status == "completed"
    jsonschema.validate(json.loads(call.arguments), WEATHER)
    # Second turn: the call as the first response returned it, and the function's result.
    second = client.responses.create(
        model=MODEL,
        input=[
            user,
            *[item.model_dump(exclude_none=True) for item in first.output],
            {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21C"},
        ],
        tools=TOOLS,
        max_output_tokens=3,
        temperature=0.0,
    )
    assert second.status in ("completed", "incomplete")
    assert first.usage is not None and second.usage is not None
    # The call and its result are in the prompt now.
    assert second.usage.input_tokens > first.usage.input_tokens + 10
    # tool_choice "required": at least one call, of the declared tools.
    required = client.responses.create(
        model=MODEL,
        input=[user],
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        max_output_tokens=60,
        temperature=0.0,
    )
    assert [i.type for i in required.output] == ["function_call"]
    assert required.output[0].name in ("weather", "clock")


def test_stream_helper_assembles_the_response(client: openai.OpenAI) -> None:
    text_format = {"format": {"type": "json_schema", "name": "point", "schema": POINT}}
    with client.responses.stream(
        model=MODEL, input="A point:", text=text_format, max_output_tokens=20, temperature=0.0
    ) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert final.status == "completed" and final.output_text == deltas
    jsonschema.validate(json.loads(final.output_text), POINT)
    # A streamed forced call: its arguments arrive as function_call_arguments events.
    with client.responses.stream(
        model=MODEL,
        input="Weather?",
        tools=TOOLS,
        tool_choice={"type": "function", "name": "weather"},
        max_output_tokens=60,
        temperature=0.0,
    ) as stream:
        kinds = [e.type for e in stream]
        called = stream.get_final_response()
    assert "response.function_call_arguments.done" in kinds
    (call,) = called.output
    assert call.type == "function_call"
    jsonschema.validate(json.loads(call.arguments), WEATHER)


@pytest.mark.parametrize(
    ("kw", "param"),
    [
        ({"previous_response_id": "resp_123"}, "previous_response_id"),
        ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"reasoning": {"effort": "low"}}, "reasoning"),
        ({"extra_body": {"unknown_field": 1}}, "unknown_field"),
        ({"temperature": "hot"}, "temperature"),
    ],
)
def test_unsupported_fields_are_400s_naming_them(
    client: openai.OpenAI, kw: dict[str, Any], param: str
) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(model=MODEL, input="Hi", max_output_tokens=2, **kw)
    body = err.value.body
    assert isinstance(body, dict) and body.get("param") == param, body


def test_the_route_needs_the_api_key(kvray_app: App) -> None:
    with pytest.raises(openai.AuthenticationError):
        openai_client(kvray_app, api_key="wrong-key").responses.create(model=MODEL, input="Hi")
    bare = httpx.post(
        f"{kvray_app.base_url}/v1/responses", json={"model": MODEL, "input": "Hi"}, timeout=60
    )
    assert bare.status_code == 401
    assert bare.json()["error"]["type"] == "authentication_error"

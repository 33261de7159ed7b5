"""Structured outputs and tool calls over the OpenAI HTTP API, end to end: the shared app
(tests/cluster/conftest.py), the official `openai` client, the demo model. Its unconstrained
output is near-random, so every valid answer here comes from the constraint."""

from __future__ import annotations

import json
import re
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from tests.cluster.serve_helpers import App, openai_client

pytestmark = pytest.mark.slow

MODEL = "kvray-demo"
PROMPT = [{"role": "user", "content": "Answer in JSON."}]
# Bounded schemas (lengths, ranges, item counts, enums), so an answer ends within max_tokens.
SCHEMAS: list[dict[str, Any]] = [
    {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 12},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
        },
        "required": ["name", "age"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "tags": {
                "type": "array",
                "items": {"type": "string", "enum": ["red", "green", "blue"]},
                "minItems": 1,
                "maxItems": 3,
            },
            "point": {
                "type": "object",
                "properties": {
                    "x": {"type": "integer", "minimum": -5, "maximum": 5},
                    "y": {"type": "integer", "minimum": -5, "maximum": 5},
                },
                "required": ["x", "y"],
                "additionalProperties": False,
            },
        },
        "required": ["tags", "point"],
        "additionalProperties": False,
    },
    {"type": "array", "items": {"type": "boolean"}, "minItems": 2, "maxItems": 4},
    {
        "type": "object",
        "properties": {"s": {"type": "string", "minLength": 3, "maxLength": 5}},
        "required": ["s"],
        "additionalProperties": False,
    },
]
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
CLOCK = {
    "type": "object",
    "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
    "required": ["zone"],
    "additionalProperties": False,
}
TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {"name": "weather", "description": "Forecast", "parameters": WEATHER},
    },
    {"type": "function", "function": {"name": "clock", "parameters": CLOCK}},
]
PARAMS = {"weather": WEATHER, "clock": CLOCK}


@pytest.fixture(scope="module")
def client(kvray_app: App) -> openai.OpenAI:
    return openai_client(kvray_app)


def _sampling(seeded: bool) -> dict[str, Any]:
    return {"temperature": 1.0, "seed": 7} if seeded else {"temperature": 0.0}


def _chat_text(client: openai.OpenAI, stream: bool, **kw: Any) -> tuple[str, str]:
    """(text, finish_reason) of a one-choice chat answer, streamed or not."""
    if not stream:
        resp = client.chat.completions.create(model=MODEL, messages=PROMPT, **kw)
        return resp.choices[0].message.content or "", resp.choices[0].finish_reason
    chunks = list(client.chat.completions.create(model=MODEL, messages=PROMPT, stream=True, **kw))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return text, chunks[-1].choices[0].finish_reason


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("seeded", [False, True])
def test_json_schema_outputs_validate(client: openai.OpenAI, stream: bool, seeded: bool) -> None:
    for schema in SCHEMAS:
        rf = {"type": "json_schema", "json_schema": {"name": "out", "schema": schema}}
        text, finish = _chat_text(
            client, stream, response_format=rf, max_tokens=200, **_sampling(seeded)
        )
        assert finish == "stop", text
        jsonschema.validate(json.loads(text), schema)


def test_completions_take_response_format_too(client: openai.OpenAI) -> None:
    schema = SCHEMAS[0]
    resp = client.completions.create(
        model=MODEL,
        prompt="JSON:",
        max_tokens=200,
        temperature=0,
        extra_body={
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": schema},
            }
        },
    )
    jsonschema.validate(json.loads(resp.choices[0].text), schema)


def _json_object_prefix(text: str) -> bool:
    """A cut-off answer is the start of a JSON object (one closing tail makes it parse)."""
    for tail in ("", '"', "}", '"}', '":0}', ":0}", "]}", '"]}'):
        try:
            return isinstance(json.loads(text + tail), dict)
        except json.JSONDecodeError:
            continue
    return False


def test_json_object_outputs_are_objects(client: openai.OpenAI) -> None:
    for stream in (False, True):
        text, finish = _chat_text(
            client,
            stream,
            response_format={"type": "json_object"},
            max_tokens=48,
            **_sampling(True),
        )
        assert text.startswith("{")
        if finish == "stop":
            assert isinstance(json.loads(text), dict)
        else:
            assert finish == "length" and _json_object_prefix(text), text


REGEX = r"[0-9]{3}-[a-z]{2,4}"
CHOICES = ["alpha", "beta", "gamma delta"]
GRAMMAR = 'start: "yes" | "no" | "it depends"'


@pytest.mark.parametrize("stream", [False, True])
def test_regex_choice_grammar_and_guided_aliases(client: openai.OpenAI, stream: bool) -> None:
    cases: list[tuple[dict[str, Any], Any]] = [
        ({"structured_outputs": {"regex": REGEX}}, lambda t: re.fullmatch(REGEX, t)),
        ({"guided_regex": REGEX}, lambda t: re.fullmatch(REGEX, t)),
        ({"structured_outputs": {"choice": CHOICES}}, lambda t: t in CHOICES),
        ({"guided_choice": CHOICES}, lambda t: t in CHOICES),
        ({"structured_outputs": {"grammar": GRAMMAR}}, lambda t: t in ("yes", "no", "it depends")),
        ({"guided_grammar": GRAMMAR}, lambda t: t in ("yes", "no", "it depends")),
        (
            {"guided_json": SCHEMAS[3]},
            lambda t: jsonschema.validate(json.loads(t), SCHEMAS[3]) is None,
        ),
        ({"structured_outputs": {"json": SCHEMAS[2]}}, lambda t: len(json.loads(t)) >= 2),
    ]
    for seeded in (False, True):
        for body, ok in cases:
            text, finish = _chat_text(
                client, stream, max_tokens=100, extra_body=body, **_sampling(seeded)
            )
            assert finish == "stop" and ok(text), (body, text)


def _check_calls(calls: list[Any], names: set[str], most: int | None = None) -> None:
    assert calls and (most is None or len(calls) <= most)
    assert len({c.id for c in calls}) == len(calls)
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), PARAMS[call.function.name])


@pytest.mark.parametrize(
    ("choice", "parallel", "names", "most"),
    [
        ("required", None, {"weather", "clock"}, None),
        ("required", False, {"weather", "clock"}, 1),
        ({"type": "function", "function": {"name": "clock"}}, None, {"clock"}, 1),
    ],
)
def test_required_and_named_calls_are_valid(
    client: openai.OpenAI, choice: Any, parallel: bool | None, names: set[str], most: int | None
) -> None:
    kw: dict[str, Any] = {"tools": TOOLS, "tool_choice": choice, "max_tokens": 300}
    if parallel is not None:
        kw["parallel_tool_calls"] = parallel
    for seeded in (False, True):
        resp = client.chat.completions.create(
            model=MODEL, messages=PROMPT, **kw, **_sampling(seeded)
        )
        (ch,) = resp.choices
        assert ch.finish_reason == "tool_calls" and ch.message.content is None
        _check_calls(ch.message.tool_calls or [], names, most)
        # Streamed, assembled by the openai client's own stream helper.
        with client.chat.completions.stream(
            model=MODEL, messages=PROMPT, **kw, **_sampling(seeded)
        ) as stream:
            final = stream.get_final_completion()
        (sch,) = final.choices
        assert sch.finish_reason == "tool_calls"
        _check_calls(sch.message.tool_calls or [], names, most)
        if not seeded:  # greedy: the streamed calls are the same calls
            assert [(c.function.name, c.function.arguments) for c in sch.message.tool_calls] == [
                (c.function.name, c.function.arguments) for c in ch.message.tool_calls
            ]


def test_auto_and_none_answer_with_text(client: openai.OpenAI) -> None:
    for choice in ("auto", "none"):
        resp = client.chat.completions.create(
            model=MODEL,
            messages=PROMPT,
            tools=TOOLS,
            tool_choice=choice,
            max_tokens=8,
            temperature=0,
        )
        (ch,) = resp.choices
        assert ch.finish_reason in ("stop", "length") and not ch.message.tool_calls


def test_a_tool_result_round_trips_through_the_template(
    client: openai.OpenAI, kvray_app: App
) -> None:
    first = client.chat.completions.create(
        model=MODEL,
        messages=PROMPT,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "weather"}},
        max_tokens=100,
        temperature=0,
    )
    call = first.choices[0].message.tool_calls[0]
    messages: list[Any] = [
        *PROMPT,
        first.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21C"},
    ]
    second = client.chat.completions.create(
        model=MODEL, messages=messages, tools=TOOLS, max_tokens=4, temperature=0
    )
    assert second.choices[0].finish_reason in ("stop", "length", "tool_calls")
    # What the server rendered: the call as the template writes it, then the tool's result.
    headers = {"Authorization": f"Bearer {kvray_app.api_key}"}
    body = {"model": MODEL, "messages": messages, "tools": TOOLS}
    ids = httpx.post(f"{kvray_app.base_url}/tokenize", json=body, headers=headers, timeout=60)
    ids.raise_for_status()
    assert ids.json()["count"] == second.usage.prompt_tokens
    text = httpx.post(
        f"{kvray_app.base_url}/detokenize",
        json={"tokens": ids.json()["tokens"]},
        headers=headers,
        timeout=60,
    ).json()["prompt"]
    args = json.loads(call.function.arguments)
    written = f'<tool_call>\n{{"name": "weather", "arguments": {json.dumps(args)}}}\n</tool_call>'
    assert written in text
    assert "<tool_response>\nsunny, 21C\n</tool_response>" in text
    assert '"name": "clock"' in text  # the tools are listed


@pytest.mark.parametrize(
    ("kw", "param"),
    [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "strin"}},
                }
            },
            "response_format.json_schema.schema",
        ),
        ({"extra_body": {"structured_outputs": {"regex": "[a-"}}}, "structured_outputs.regex"),
        ({"extra_body": {"guided_grammar": "start: ("}}, "guided_grammar"),
        ({"extra_body": {"guided_regex": "a", "guided_choice": ["b"]}}, "guided_choice"),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice.function.name",
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "bad name"}}]},
            "tools[0].function.name",
        ),
        ({"tool_choice": "required"}, "tool_choice"),
        (
            {
                "tools": [
                    {
                        "type": "function",
                        "function": {
                            "name": "f",
                            "parameters": {
                                "type": "object",
                                "properties": {"a": {"type": "strin"}},
                            },
                        },
                    }
                ]
            },
            "tools[0].function.parameters",
        ),
    ],
)
def test_bad_constraints_and_tools_are_400s_naming_the_field(
    client: openai.OpenAI, kw: dict[str, Any], param: str
) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=PROMPT, max_tokens=4, **kw)
    assert err.value.status_code == 400
    body = err.value.body
    assert isinstance(body, dict) and body.get("param") == param, body


def test_auto_reads_tool_call_blocks_from_the_text(client: openai.OpenAI) -> None:
    # A regex makes the demo model write what a real one would: text, then a call in the
    # template's <tool_call> convention, which tool_choice "auto" reads out.
    regex = (
        r"Checking\.\n<tool_call>\n"
        r'\{"name": "clock", "arguments": \{"zone": "(UTC|CET)"\}\}\n</tool_call>'
    )
    kw: dict[str, Any] = {
        "tools": TOOLS,
        "tool_choice": "auto",
        "max_tokens": 100,
        "temperature": 0,
        "extra_body": {"guided_regex": regex},
    }
    resp = client.chat.completions.create(model=MODEL, messages=PROMPT, **kw)
    (ch,) = resp.choices
    assert ch.finish_reason == "tool_calls" and ch.message.content == "Checking."
    _check_calls(ch.message.tool_calls or [], {"clock"}, 1)
    with client.chat.completions.stream(model=MODEL, messages=PROMPT, **kw) as stream:
        (sch,) = stream.get_final_completion().choices
    assert sch.finish_reason == "tool_calls" and sch.message.content == "Checking."
    assert [c.function.arguments for c in sch.message.tool_calls or []] == [
        c.function.arguments for c in ch.message.tool_calls or []
    ]

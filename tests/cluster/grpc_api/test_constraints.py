"""kvray.v1 output constraints and tools -> the shared ingress types, and responses with tool
calls (cluster/grpc_api/constraints.py, convert.py), no server: errors name the field where
the client set it."""

from __future__ import annotations

import json

import pytest

from cluster.errors import InvalidRequestError
from cluster.grpc_api import constraints
from cluster.grpc_api import convert as conv
from cluster.grpc_api.client import build_generate_request
from kvray.v1 import llm_pb2
from workers.outputs import CompletionOutput, RequestOutput
from workers.structured import StructuredOutputs

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}}
USER = [{"role": "user", "content": "hi"}]
TOOLS = [
    {"type": "function", "function": {"name": "weather", "parameters": SCHEMA}},
    {"type": "function", "function": {"name": "time", "description": "now"}},
]


def _params(**kw: object) -> StructuredOutputs | None:
    req = build_generate_request("x", **kw)
    return conv.sampling_params(req, stream=False).structured_outputs


@pytest.mark.parametrize(
    ("kw", "want"),
    [
        ({"json_schema": SCHEMA}, StructuredOutputs.from_schema(SCHEMA)),
        ({"json_schema": json.dumps(SCHEMA)}, StructuredOutputs.from_schema(SCHEMA)),
        ({"json_object": True}, StructuredOutputs(json_object=True)),
        ({"regex": "[a-z]+"}, StructuredOutputs(regex="[a-z]+")),
        ({"choice": ["a", "b"]}, StructuredOutputs(choice=("a", "b"))),
        ({"grammar": 'start: "x"'}, StructuredOutputs(grammar='start: "x"')),
        ({}, None),
    ],
)
def test_the_sampling_oneof_becomes_the_engine_constraint(kw: dict, want: object) -> None:
    assert _params(**kw) == want


@pytest.mark.parametrize(
    ("kw", "param"),
    [
        ({"json_schema": "{nope"}, "sampling.json_schema"),
        ({"json_schema": "[1]"}, "sampling.json_schema"),
        ({"regex": ""}, "sampling.regex"),
        ({"choice": []}, "sampling.choice"),
        ({"choice": ["a", ""]}, "sampling.choice"),
        ({"grammar": ""}, "sampling.grammar"),
    ],
)
def test_bad_constraints_name_the_field(kw: dict, param: str) -> None:
    with pytest.raises(InvalidRequestError) as err:
        _params(**kw)
    assert err.value.param == param


def _chat(**kw: object) -> llm_pb2.GenerateRequest:
    return build_generate_request(messages=USER, tools=TOOLS, **kw)


def test_tools_and_tool_choice() -> None:
    use = constraints.tool_use(_chat().chat)
    assert use is not None and use.choice.mode == "auto" and use.names() == {"weather", "time"}
    assert use.tools[0].parameters == SCHEMA
    req = _chat(tool_choice="required", parallel_tool_calls=False)
    use = constraints.tool_use(req.chat)
    assert use is not None and use.choice.mode == "required" and not use.parallel
    spec = conv.sampling_params(req, stream=False).structured_outputs
    assert spec is not None and json.loads(spec.json or "")["maxItems"] == 1
    named = constraints.tool_use(_chat(tool_choice={"name": "time"}).chat)
    assert named is not None and named.choice.name == "time"
    assert constraints.tool_use(build_generate_request(messages=USER).chat) is None


@pytest.mark.parametrize(
    ("req", "param"),
    [
        (lambda: _chat(tool_choice={"name": "nope"}), "chat.tool_choice.function_name"),
        (lambda: _chat(tool_choice="required", regex="a"), "chat.tools"),
        (
            lambda: build_generate_request(messages=USER, tool_choice="required"),
            "chat.tool_choice",
        ),
        (
            lambda: build_generate_request(messages=USER, tools=[{"name": "a b"}]),
            "chat.tools[0].name",
        ),
        (
            lambda: build_generate_request(messages=USER, tools=[TOOLS[1], TOOLS[1]]),
            "chat.tools[1].name",
        ),
    ],
)
def test_bad_tools_name_the_field(req: object, param: str) -> None:
    with pytest.raises(InvalidRequestError) as err:
        conv.sampling_params(req(), stream=False)  # type: ignore[operator]
    assert err.value.param == param


def test_bad_parameters_json_names_the_field() -> None:
    req = build_generate_request(messages=USER)
    req.chat.tools.add(name="f", parameters_json="{oops")
    with pytest.raises(InvalidRequestError) as err:
        conv.sampling_params(req, stream=False)
    assert err.value.param == "chat.tools[0].parameters_json"


def test_messages_with_tool_calls_reach_the_template() -> None:
    call = {"id": "call_1", "type": "function", "function": {"name": "time", "arguments": "{}"}}
    req = build_generate_request(
        messages=[
            *USER,
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_1", "content": "noon"},
        ]
    )
    msgs = conv.chat_messages(req.chat)
    assert msgs[1]["tool_calls"] == [
        {"type": "function", "id": "call_1", "function": {"name": "time", "arguments": {}}}
    ]
    assert msgs[2] == {"role": "tool", "content": "noon", "tool_call_id": "call_1"}


ARRAY = '[{"arguments":{"a":1},"name":"weather"},{"arguments":{},"name":"time"}]'


def _ctx(choice: str) -> conv.ResponseContext:
    use = constraints.tool_use(_chat(tool_choice=choice).chat)
    return conv.ResponseContext("r", "m", tools=use)


def test_responses_carry_tool_calls_whole_and_streamed() -> None:
    final = RequestOutput("r", None, [1], [CompletionOutput(0, ARRAY, [1, 2], "stop")], True)
    (c,) = conv.final_response(final, _ctx("required")).completions
    assert c.text == "" and c.finish_reason == llm_pb2.FINISH_REASON_TOOL_CALLS
    assert [(t.name, json.loads(t.arguments)) for t in c.tool_calls] == [
        ("weather", {"a": 1}),
        ("time", {}),
    ]
    assert all(t.id.startswith("call_") for t in c.tool_calls)
    state, ctx, streamed = conv.StreamState(), _ctx("required"), []
    pieces = [ARRAY[i : i + 5] for i in range(0, len(ARRAY), 5)]
    for i, piece in enumerate(pieces):
        last = i == len(pieces) - 1
        delta = CompletionOutput(
            0, "", [], "stop" if last else None, delta_text=piece, delta_token_ids=[i]
        )
        msg = conv.stream_response(RequestOutput("r", None, [1], [delta], last), state, ctx)
        if msg is not None:
            streamed.extend(msg.completions)
    calls = [(t.name, json.loads(t.arguments)) for m in streamed for t in m.tool_calls]
    assert calls == [("weather", {"a": 1}), ("time", {})]
    assert "".join(m.text for m in streamed) == ""
    assert streamed[-1].finish_reason == llm_pb2.FINISH_REASON_TOOL_CALLS


def test_auto_keeps_plain_text_and_no_tools_changes_nothing() -> None:
    text = 'Hi <tool_call>{"name": "time", "arguments": {}}</tool_call>'
    final = RequestOutput("r", None, [1], [CompletionOutput(0, text, [1], "stop")], True)
    (c,) = conv.final_response(final, _ctx("auto")).completions
    assert c.text == "Hi" and [t.name for t in c.tool_calls] == ["time"]
    (c,) = conv.final_response(final, conv.ResponseContext("r", "m")).completions
    assert c.text == text and not c.tool_calls and c.finish_reason == llm_pb2.FINISH_REASON_STOP

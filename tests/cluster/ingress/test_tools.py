"""OpenAI tools at the ingress (cluster/ingress/tools.py, tool_calls.py): checks naming the
field, the JSON schema of constrained calls, the `<tool_call>` and JSON-array parsers (whole
and fed in pieces of every size), and the demo chat template rendering tools, calls and
tool results."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest

from cluster.errors import InvalidRequestError
from cluster.http.protocol import ChatCompletionRequest
from cluster.ingress import tools
from cluster.ingress.tool_calls import ToolCall, ToolCallParser, parse_all

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Rome"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
}
TOOLS = [
    {"type": "function", "function": {"name": "weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "time", "description": "Now"}},
]
NAMES = {"weather", "time"}


def _use(choice: object = None, parallel: bool | None = None) -> tools.ToolUse:
    use = tools.tool_use(TOOLS, choice, parallel)
    assert use is not None
    return use


def test_tools_and_choices_parse() -> None:
    use = _use()
    assert [t.name for t in use.tools] == ["weather", "time"]
    assert use.choice == tools.ToolChoice("auto") and use.parses and use.constraint() is None
    assert use.tools[1].parameters == tools.EMPTY_PARAMETERS
    assert _use("none").parses is False
    assert _use("required").choice.constrained
    named = _use({"type": "function", "function": {"name": "time"}})
    assert named.choice == tools.ToolChoice("named", "time")
    assert tools.tool_use(None, None, None) is None
    assert tools.tool_use(None, "none", None) is None


@pytest.mark.parametrize(
    ("tool_list", "choice", "param"),
    [
        ([{"type": "retrieval"}], None, "tools[0].type"),
        ([{"type": "function"}], None, "tools[0].function"),
        ([{"type": "function", "function": {"name": "a b"}}], None, "tools[0].function.name"),
        ([{"type": "function", "function": {}}], None, "tools[0].function.name"),
        (
            [{"type": "function", "function": {"name": "f", "parameters": [1]}}],
            None,
            "tools[0].function.parameters",
        ),
        (
            [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}],
            None,
            "tools[0].function.parameters",
        ),
        ([*TOOLS, TOOLS[0]], None, "tools[2].function.name"),
        ("weather", None, "tools"),
        (TOOLS, "sometimes", "tool_choice"),
        (TOOLS, {"type": "function", "function": {"name": "nope"}}, "tool_choice.function.name"),
        (TOOLS, {"type": "function"}, "tool_choice"),
        (None, "required", "tool_choice"),
        (None, {"type": "function", "function": {"name": "f"}}, "tool_choice"),
    ],
)
def test_bad_tools_name_the_field(tool_list: object, choice: object, param: str) -> None:
    with pytest.raises(InvalidRequestError) as err:
        tools.tool_use(tool_list, choice, None)  # type: ignore[arg-type]
    assert err.value.param == param


def test_the_request_turns_required_into_a_constraint() -> None:
    req = ChatCompletionRequest(
        messages=[{"role": "user", "content": "x"}], tools=TOOLS, tool_choice="required"
    )
    params = req.sampling_params()
    assert params.structured_outputs is not None and params.structured_outputs.json
    assert req.constraint().field == "tools"  # type: ignore[union-attr]
    both = ChatCompletionRequest(
        messages=[{"role": "user", "content": "x"}],
        tools=TOOLS,
        tool_choice="required",
        response_format={"type": "json_object"},
    )
    with pytest.raises(InvalidRequestError) as err:
        both.sampling_params()
    assert "tools" in err.value.message and "response_format" in err.value.message


def test_calls_schema_accepts_calls_and_rejects_others() -> None:
    good = [{"name": "weather", "arguments": {"city": "Rome", "days": 2}}]
    two = [*good, {"name": "time", "arguments": {}}]
    for choice, parallel, ok, bad in [
        ("required", None, [good, two], [[], [{"name": "weather", "arguments": {}}]]),
        ("required", False, [good], [two]),
        (
            {"type": "function", "function": {"name": "time"}},
            None,
            [[{"name": "time", "arguments": {}}]],
            [good, two],
        ),
    ]:
        schema = tools.calls_schema(_use(choice, parallel))
        jsonschema.Draft202012Validator.check_schema(schema)
        for value in ok:
            jsonschema.validate(value, schema)
        for value in bad:
            with pytest.raises(jsonschema.ValidationError):
                jsonschema.validate(value, schema)


AUTO_TEXT = (
    "Let me check.\n<tool_call>\n"
    '{"name": "weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>\n'
    '<tool_call>{"name": "time", "arguments": "{}"}</tool_call>\n'
    '<tool_call>{"name": "unknown", "arguments": {}}</tool_call>'
)


def _pieces(text: str, size: int, parser: ToolCallParser) -> list:
    events = []
    for i in range(0, len(text), size):
        events += parser.feed(text[i : i + size])
    return events + parser.finish()


def _summary(events: list) -> tuple[str, list[tuple[str, dict]]]:
    content = "".join(e for e in events if isinstance(e, str))
    calls = [(e.name, json.loads(e.arguments)) for e in events if isinstance(e, ToolCall)]
    return content, calls


def test_auto_parser_reads_tool_call_blocks_whole_and_in_pieces() -> None:
    content, calls = parse_all(AUTO_TEXT, NAMES, constrained=False)
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("weather", {"city": "Paris", "days": 3}),
        ("time", {}),
    ]
    assert all(c.id.startswith("call_") for c in calls) and calls[0].id != calls[1].id
    # An unknown tool's block is not a call: it stays in the content, nothing is lost.
    assert content == ('Let me check.\n<tool_call>{"name": "unknown", "arguments": {}}</tool_call>')
    whole = _summary(_pieces(AUTO_TEXT, len(AUTO_TEXT), ToolCallParser(NAMES, False)))
    for size in range(1, 20):
        assert _summary(_pieces(AUTO_TEXT, size, ToolCallParser(NAMES, False))) == whole


def test_auto_parser_plain_text_and_unclosed_blocks() -> None:
    assert parse_all("just text", NAMES, False) == ("just text", [])
    assert parse_all("a <tool_call>{", NAMES, False) == ("a <tool_call>{", [])
    assert parse_all("x <tool_ca", NAMES, False) == ("x <tool_ca", [])
    assert parse_all("", NAMES, False) == (None, [])
    content, calls = parse_all(
        '<tool_call>{"name":"time","arguments":{}}</tool_call>', NAMES, False
    )
    assert content is None and len(calls) == 1


def test_constrained_parser_reads_the_array_in_pieces() -> None:
    text = (
        '[{"arguments":{"city":"Rome","days":1},"name":"weather"},{"arguments":{},"name":"time"}]'
    )
    content, calls = parse_all(text, NAMES, constrained=True)
    assert content is None
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("weather", {"city": "Rome", "days": 1}),
        ("time", {}),
    ]
    for size in range(1, 12):
        assert _summary(_pieces(text, size, ToolCallParser(NAMES, True))) == (
            "",
            _summary(_pieces(text, len(text), ToolCallParser(NAMES, True)))[1],
        )
    # Braces and quotes inside strings do not confuse it.
    tricky = '[{"arguments":{"q":"}{\\"]"},"name":"weather"}]'
    assert json.loads(parse_all(tricky, NAMES, True)[1][0].arguments) == {"q": '}{"]'}
    # Cut off before the first call is whole (max_tokens): the text is the content.
    assert parse_all('[{"arguments":{"ci', NAMES, True) == ('[{"arguments":{"ci', [])


def test_template_tool_calls_take_arguments_as_objects() -> None:
    calls = [
        {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}},
        {"type": "function", "function": {"name": "g", "arguments": "not json"}},
    ]
    out = tools.template_tool_calls(calls)
    assert out[0] == {
        "type": "function",
        "id": "call_1",
        "function": {"name": "f", "arguments": {"a": 1}},
    }
    assert out[1]["function"]["arguments"] == "not json"
    with pytest.raises(InvalidRequestError):
        tools.template_tool_calls([{"type": "function"}])


def test_a_tool_round_trip_renders_through_the_demo_template(demo_dir: Path) -> None:
    from workers.tokenizer import Tokenizer

    req = ChatCompletionRequest(
        messages=[
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Weather in Paris?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "call_7",
                        "type": "function",
                        "function": {
                            "name": "weather",
                            "arguments": '{"city": "Paris", "days": 2}',
                        },
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "call_7", "content": "sunny, 21C"},
        ],
        tools=TOOLS,
    )
    use = req.tool_use()
    assert use is not None
    text = Tokenizer.from_pretrained(demo_dir).render_chat_template(
        req.template_messages(), tools=use.template_tools()
    )
    system, user, assistant, tool, prompt = text.split("<|im_end|>\n")
    assert system.startswith("<|im_start|>system\nBe brief.\n\n") and "<tools>" in system
    listed = system.split("<tools>\n")[1].split("\n</tools>")[0].splitlines()
    assert [json.loads(line)["function"]["name"] for line in listed] == ["weather", "time"]
    assert user == "<|im_start|>user\nWeather in Paris?"
    assert assistant == (
        '<|im_start|>assistant\n<tool_call>\n{"name": "weather", "arguments": '
        '{"city": "Paris", "days": 2}}\n</tool_call>'
    )
    assert tool == "<|im_start|>user\n<tool_response>\nsunny, 21C\n</tool_response>"
    assert prompt == "<|im_start|>assistant\n"
    # The call the template wrote is what the parser reads back.
    _, calls = parse_all(assistant.split("\n", 1)[1], NAMES, constrained=False)
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("weather", {"city": "Paris", "days": 2})
    ]


def test_parallel_tool_calls_false_keeps_the_first_call_only() -> None:
    use = _use("auto", parallel=False)
    parser = use.parser()
    events = parser.feed(AUTO_TEXT) + parser.finish()
    assert [e.name for e in events if isinstance(e, ToolCall)] == ["weather"]
    _, calls = parse_all(AUTO_TEXT, NAMES, constrained=False, max_calls=1)
    assert len(calls) == 1
    assert parse_all(AUTO_TEXT, NAMES, constrained=False)[1][1].name == "time"

"""Qwen3-Coder XML tool calls (cluster/ingress/tool_formats/qwen3_coder.py)."""

from __future__ import annotations

import pytest

from cluster.ingress.tool_formats.qwen3_coder import Qwen3CoderParser, convert
from tests.cluster.ingress.tool_formats.cases import (
    NAMES,
    PARAMETERS,
    SEARCH_CALL,
    WEATHER_CALL,
    check_round_trips,
    read,
    render,
)

# Qwen3-Coder's convention: each call in its own block, each argument a <parameter> whose
# value is on lines of its own: objects and arrays as JSON, everything else as plain text.
TEMPLATE = """\
{% for m in messages %}
{% if m.role == 'assistant' %}<|im_start|>assistant
<turn>{{ m.content }}
{% for tc in m.tool_calls %}
<tool_call>
<function={{ tc.function.name }}>
{% for key, value in tc.function.arguments.items() %}
<parameter={{ key }}>
{% if value is mapping or (value is iterable and value is not string) %}\
{{ value | tojson }}{% else %}{{ value | string }}{% endif %}

</parameter>
{% endfor %}
</function>
</tool_call>
{% endfor %}</turn><|im_end|>
{% else %}<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endif %}
{% endfor %}"""


def make(max_calls: int | None = None) -> Qwen3CoderParser:
    return Qwen3CoderParser(NAMES, False, max_calls, PARAMETERS)


def test_the_template_calls_read_back_with_their_types() -> None:
    check_round_trips(make, TEMPLATE)


def test_string_values_keep_their_text_exactly() -> None:
    code = 'def f(x):\n    return "<b>" if x else 42\n\n'
    call = ("search", {"query": "42", "code": code, "limit": 7})
    assert read(make, render(TEMPLATE, [call])) == (None, [call])


def test_without_schemas_every_value_is_a_string() -> None:
    text = render(TEMPLATE, [WEATHER_CALL])
    assert read(lambda most: Qwen3CoderParser(NAMES, False, most), text) == (
        None,
        [("get_weather", {"city": "Paris", "unit": "c", "days": "3"})],
    )


@pytest.mark.parametrize(
    ("text", "schema", "value"),
    [
        ("3", {"type": "integer"}, 3),
        ("3.0", {"type": "integer"}, 3),
        ("3.5", {"type": "integer"}, "3.5"),  # not the declared type: kept as written
        ("-2.5e1", {"type": "number"}, -25.0),
        ("True", {"type": "boolean"}, True),
        ("false", {"type": "boolean"}, False),
        ("yes", {"type": "boolean"}, "yes"),
        ("null", {"type": ["integer", "null"]}, None),
        ("7", {"anyOf": [{"type": "integer"}, {"type": "null"}]}, 7),
        ('{"a": [1, true]}', {"type": "object"}, {"a": [1, True]}),
        ("{'a': True, 'b': None}", {"type": "object"}, {"a": True, "b": None}),
        ("[1, 2]", {"type": "array"}, [1, 2]),
        ("[1, 2", {"type": "array"}, "[1, 2"),
        ("{1, 2}", {"type": "array"}, "{1, 2}"),  # a Python set is not JSON
        ("__import__('os')", {"type": "object"}, "__import__('os')"),  # never evaluated
        ("007", {"type": "string"}, "007"),
        ("12", None, "12"),  # an undeclared parameter
        ('{"x": 1}', {"type": "any"}, {"x": 1}),
    ],
)
def test_values_convert_by_the_declared_type(text: str, schema: object, value: object) -> None:
    assert convert(text, schema) == value


def test_malformed_blocks_and_unknown_tools_stay_content() -> None:
    good = render(TEMPLATE, [SEARCH_CALL])
    for bad in (
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</function>\n</tool_call>",
        "<tool_call>\n<function=get_weather>\nParis\n</function>\n</tool_call>",
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</tool_call>",
        "<tool_call>\n<function=nope>\n</function>\n</tool_call>",
    ):
        assert read(make, bad + "\n" + good) == (bad, [SEARCH_CALL])
    cut = "<tool_call>\n<function=get_weather>\n<parameter=city>\nPar"
    assert read(make, "See: " + cut) == ("See: " + cut, [])


def test_hermes_json_bodies_are_read_too() -> None:
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    assert read(make, text) == (None, [("get_weather", {"city": "Paris"})])


def test_a_call_without_parameters() -> None:
    text = "<tool_call>\n<function=search>\n</function>\n</tool_call>"
    assert read(make, text) == (None, [("search", {})])

"""Pythonic tool calls (cluster/ingress/tool_formats/pythonic.py)."""

from __future__ import annotations

import pytest

from cluster.ingress.tool_formats.pythonic import PythonicParser, parse_calls
from tests.cluster.ingress.tool_formats.cases import (
    NAMES,
    SEARCH_CALL,
    WEATHER_CALL,
    check_round_trips,
    read,
    render,
)

# Llama 3.2 / 4's pythonic convention: the turn is a Python list of calls with literal keyword
# arguments; text before it ends with <|python_start|> and the list with <|python_end|>.
TEMPLATE = """\
{% macro py(v) %}{% if v is boolean %}{{ 'True' if v else 'False' }}\
{% elif v is none %}None{% elif v is string %}{{ v | tojson }}\
{% elif v is number %}{{ v }}{% elif v is mapping %}{{ '{' }}\
{% for k, x in v.items() %}{{ k | tojson }}: {{ py(x) }}{% if not loop.last %}, {% endif %}\
{% endfor %}{{ '}' }}{% else %}[{% for x in v %}{{ py(x) }}{% if not loop.last %}, {% endif %}\
{% endfor %}]{% endif %}{% endmacro %}
{% for m in messages %}
<|header_start|>{{ m.role }}<|header_end|>

{% if m.role == 'assistant' %}<turn>\
{% if m.content %}{{ m.content }}<|python_start|>{% endif %}[\
{% for tc in m.tool_calls %}{{ tc.function.name }}(\
{% for k, v in tc.function.arguments.items() %}{{ k }}={{ py(v) }}\
{% if not loop.last %}, {% endif %}{% endfor %}){% if not loop.last %}, {% endif %}\
{% endfor %}]{% if m.content %}<|python_end|>{% endif %}</turn><|eom|>\
{% else %}{{ m.content }}<|eot|>{% endif %}
{% endfor %}"""


def make(max_calls: int | None = None) -> PythonicParser:
    return PythonicParser(NAMES, False, max_calls)


def test_the_template_calls_read_back() -> None:
    check_round_trips(make, TEMPLATE)


def test_literals_become_json() -> None:
    text = "[search(limit=-3, score=+1.5, exact=false, tags=('a', 'b'), filters={'k': None})]"
    args = {"limit": -3, "score": 1.5, "exact": False, "tags": ["a", "b"], "filters": {"k": None}}
    assert read(make, text) == (None, [("search", args)])
    assert read(make, "[search()]") == (None, [("search", {})])


@pytest.mark.parametrize(
    "text",
    [
        "[get_weather('Paris')]",  # positional
        "[get_weather(city=__import__('os').getcwd())]",  # not a literal: never evaluated
        "[get_weather(city=x)]",  # a variable
        "[get_weather(**{'city': 'Paris'})]",
        "[get_weather(city={1: 2})]",  # a key JSON cannot carry
        "[get_weather(city=b'x')]",
        "[get_weather(city=float('nan'))]",
        "[get_weather(city='Paris'), 3]",
        "[get_weather(city='Paris'), launch_rockets(count=1)]",  # all or nothing
        "[]",
        "(get_weather(city='Paris'))",
    ],
)
def test_what_is_not_a_list_of_literal_calls_is_not_calls(text: str) -> None:
    assert parse_calls(text, NAMES) is None


def test_malformed_lists_stay_content_and_text_after_calls_is_content() -> None:
    bad = "[get_weather(city='Paris', days=)]"
    assert read(make, bad) == (bad, [])
    cut = "[get_weather(city='Par"
    assert read(make, cut) == (cut, [])
    good = render(TEMPLATE, [WEATHER_CALL])
    assert read(make, good + "\nAnything else?") == ("Anything else?", [WEATHER_CALL])
    assert read(make, good + " " + good) == (good, [WEATHER_CALL])  # only the first list


def test_text_that_cannot_be_calls_is_released_at_once() -> None:
    for text in ("[1] See the notes", "[A quick note]", "[get-weather]", "[]"):
        reader = make()
        assert reader.feed(text) == [text]
    reader = make()
    assert reader.feed("[get_weather") == []  # could still be a call
    assert reader.feed(" (city='Oslo')") == []
    assert [e.name for e in reader.feed("]")] == ["get_weather"]  # type: ignore[union-attr]


def test_llama4_tags_around_the_list() -> None:
    text = "Checking.<|python_start|>[search(query='x')]<|python_end|> Done."
    assert read(make, text) == ("Checking. Done.", [("search", {"query": "x"})])
    text = "<|python_start|>not a list"
    assert read(make, text) == (text, [])
    text = "So <|python_start|> [search(q=)]"
    assert read(make, text) == (text, [])
    reader = make()
    assert reader.feed("<|python_") == []
    events = reader.feed("start|>[search()]<|python_")
    assert [e.name for e in events] == ["search"]  # type: ignore[union-attr]
    assert reader.feed("end|> ok") == ["ok"]


def test_a_search_call_with_tricky_strings() -> None:
    assert read(make, render(TEMPLATE, [SEARCH_CALL])) == (None, [SEARCH_CALL])

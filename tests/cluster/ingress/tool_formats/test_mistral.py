"""Mistral `[TOOL_CALLS]` calls, both forms (cluster/ingress/tool_formats/mistral.py)."""

from __future__ import annotations

import pytest

from cluster.ingress.tool_formats.mistral import MistralParser
from tests.cluster.ingress.tool_formats.cases import (
    NAMES,
    SEARCH_CALL,
    WEATHER_CALL,
    check_round_trips,
    read,
    render,
)

# Mistral 7B v0.3's convention: one JSON array of the calls (ids included) after the token.
ARRAY_TEMPLATE = """\
{% for m in messages %}
{% if m.role == 'user' %}[INST] {{ m.content }}[/INST]{% else %}<turn>{{ m.content }}\
[TOOL_CALLS] [{% for tc in m.tool_calls %}\
{"name": {{ tc.function.name | tojson }}, "arguments": {{ tc.function.arguments | tojson }}, \
"id": "{{ tc.id }}"}{% if not loop.last %}, {% endif %}{% endfor %}]</turn></s>{% endif %}
{% endfor %}"""

# The v11+ tokenizers' convention: each call `[TOOL_CALLS]name[CALL_ID]id[ARGS]{...}`.
NAMED_TEMPLATE = """\
{% for m in messages %}
{% if m.role == 'user' %}[INST]{{ m.content }}[/INST]{% else %}<turn>{{ m.content }}\
{% for tc in m.tool_calls %}[TOOL_CALLS]{{ tc.function.name }}[CALL_ID]{{ tc.id }}\
[ARGS]{{ tc.function.arguments | tojson }}{% endfor %}</turn></s>{% endif %}
{% endfor %}"""


def make(max_calls: int | None = None) -> MistralParser:
    return MistralParser(NAMES, False, max_calls)


@pytest.mark.parametrize("template", [ARRAY_TEMPLATE, NAMED_TEMPLATE], ids=["array", "named"])
def test_the_template_calls_read_back(template: str) -> None:
    check_round_trips(make, template)


def test_args_marker_optional_and_no_space_before_the_array() -> None:
    text = 'Sure.[TOOL_CALLS]search{"query": "x"}[TOOL_CALLS]get_weather[ARGS] {"city": "Rome"}'
    assert read(make, text) == (
        "Sure.",
        [("search", {"query": "x"}), ("get_weather", {"city": "Rome"})],
    )
    text = '[TOOL_CALLS][{"name": "search", "arguments": {}}]'
    assert read(make, text) == (None, [("search", {})])
    text = '[TOOL_CALLS]{"name": "search", "arguments": {"limit": 2}}'  # a lone object
    assert read(make, text) == (None, [("search", {"limit": 2})])


def test_the_bare_array_at_the_start_is_read_too() -> None:
    # Decoded with special tokens skipped, the [TOOL_CALLS] token is gone.
    text = render(ARRAY_TEMPLATE, [WEATHER_CALL, SEARCH_CALL]).replace("[TOOL_CALLS]", "")
    assert read(make, text) == (None, [WEATHER_CALL, SEARCH_CALL])
    for plain in ("[1] A note", "  [ ] todo", '[{"a": 1}] data', "Later: [{}]", "["):
        assert read(make, plain) == (plain.strip(), [])
    reader = make()
    assert reader.feed(" [") == [] and reader.feed("x") == ["[x"]


def test_an_array_with_any_bad_element_stays_content() -> None:
    both = render(ARRAY_TEMPLATE, [WEATHER_CALL, SEARCH_CALL]).replace('"search"', '"nope"')
    assert read(make, both) == (both, [])
    for bad in (
        '[TOOL_CALLS] [{"name": "search", "arguments": {]',  # malformed JSON
        "[TOOL_CALLS] []",  # no calls
        '[TOOL_CALLS] [{"name": "search"',  # cut short
    ):
        assert read(make, "Hm. " + bad) == ("Hm. " + bad, [])


def test_a_malformed_named_call_stays_content_and_later_calls_count() -> None:
    good = render(NAMED_TEMPLATE, [SEARCH_CALL])
    for bad in (
        '[TOOL_CALLS]get_weather[ARGS]{"city": Paris}',
        "[TOOL_CALLS]get_weather[ARGS]not json",
        "[TOOL_CALLS]get_weather[CALL_ID]!![ARGS]{}",
        "[TOOL_CALLS] I cannot call that",
    ):
        assert read(make, bad + good) == (bad, [SEARCH_CALL])
    assert read(make, "ok [TOOL_CA") == ("ok [TOOL_CA", [])
    assert read(make, "[TOOL_CALLS]get_weather[AR") == ("[TOOL_CALLS]get_weather[AR", [])


def test_markers_are_held_back_while_streaming() -> None:
    reader = make()
    assert reader.feed("Calling [TOOL") == ["Calling"]
    assert reader.feed("_CALLS]get_weather[CALL_") == []
    assert reader.feed("ID]abcdefghi[ARGS]{") == []
    events = reader.feed('"city": "Oslo"}')
    assert [e.name for e in events] == ["get_weather"]  # type: ignore[union-attr]
    assert reader.finish() == []

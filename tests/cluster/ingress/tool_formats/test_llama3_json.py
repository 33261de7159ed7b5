"""Llama 3 JSON tool calls (cluster/ingress/tool_formats/llama3_json.py)."""

from __future__ import annotations

from cluster.ingress.tool_formats.llama3_json import Llama3JsonParser
from tests.cluster.ingress.tool_formats.cases import (
    NAMES,
    SEARCH_CALL,
    WEATHER_CALL,
    check_round_trips,
    read,
    render,
)

# Llama 3.1's convention: the turn is the calls themselves, `{"name": ..., "parameters": ...}`
# joined by "; "; text before them ends with the python tag.
TEMPLATE = """\
{% for m in messages %}
<|start_header_id|>{{ m.role }}<|end_header_id|>

{% if m.role == 'assistant' %}<turn>
{% if m.content %}{{ m.content }}<|python_tag|>{% endif %}
{% for tc in m.tool_calls %}
{{ '{"name": "' + tc.function.name + '", "parameters": ' }}\
{{- tc.function.arguments | tojson }}}{% if not loop.last %}; {% endif %}
{% endfor %}
</turn><|eom_id|>{% else %}{{ m.content }}<|eot_id|>{% endif %}
{% endfor %}"""


def make(max_calls: int | None = None) -> Llama3JsonParser:
    return Llama3JsonParser(NAMES, False, max_calls)


def test_the_template_calls_read_back() -> None:
    check_round_trips(make, TEMPLATE)


def test_the_python_tag_and_arguments_key_are_accepted() -> None:
    text = '<|python_tag|>{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c", '
    text += '"days": 3}};{"name": "search", "parameters": {}}'
    assert read(make, text) == (None, [WEATHER_CALL, ("search", {})])


def test_a_json_answer_and_malformed_calls_stay_content() -> None:
    answer = '{"answer": 42, "note": "not a call"}'
    assert read(make, answer) == (answer, [])
    bad = '{"name": "get_weather", "parameters": {"city": Paris}}'
    assert read(make, bad) == (bad, [])
    assert read(make, "  " + bad[:20]) == (bad[:20], [])  # cut short: content
    # After a call, a bad object ends the list: it and what follows are content.
    good = render(TEMPLATE, [SEARCH_CALL])
    assert read(make, good + "; " + bad + " then text") == (bad + " then text", [SEARCH_CALL])


def test_only_the_start_or_the_tag_opens_calls() -> None:
    call = '{"name": "search", "parameters": {}}'
    assert read(make, "Example: " + call) == ("Example: " + call, [])
    # The tag followed by something other than a call (a built-in tool's code) is content.
    text = 'Let me.<|python_tag|>brave_search.call(query="x")'
    assert read(make, text) == (text, [])
    assert read(make, "Done. <|python_tag|>") == ("Done. <|python_tag|>", [])


def test_llama4_writes_calls_after_the_end_of_its_text() -> None:
    text = 'Checking.<|python_end|>{"name": "search", "parameters": {"limit": 1}}'
    assert read(make, text) == ("Checking.", [("search", {"limit": 1})])
    text = "Plain.<|python_end|> More text."
    assert read(make, text) == (text, [])


def test_text_after_the_calls_is_content() -> None:
    text = '{"name": "search", "parameters": {}}\n\nAnything else?'
    assert read(make, text) == ("Anything else?", [("search", {})])


def test_nothing_is_released_while_a_call_may_be_forming() -> None:
    reader = make()
    assert reader.feed("  <|python") == []
    assert reader.feed('_tag|>{"name": "search", ') == []
    events = reader.feed('"parameters": {"query": "}"}}')
    assert [e.name for e in events] == ["search"]  # type: ignore[union-attr]
    assert reader.feed(" ; ") == [] and reader.finish() == []
    reader = make()
    assert reader.feed("Hi {") == ["Hi {"]  # not at the start: prose

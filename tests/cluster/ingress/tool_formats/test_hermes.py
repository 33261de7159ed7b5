"""Hermes / Qwen `<tool_call>` JSON blocks (cluster/ingress/tool_formats/hermes.py)."""

from __future__ import annotations

from cluster.ingress.tool_formats.hermes import ToolCallParser
from tests.cluster.ingress.tool_formats.cases import (
    NAMES,
    WEATHER_CALL,
    check_round_trips,
    read,
    render,
)

# Qwen 2.5's convention: content, then each call as a JSON object in its own block.
TEMPLATE = """\
{% for m in messages %}
{% if m.role == 'assistant' %}<|im_start|>assistant
<turn>{{ m.content }}
{% for tc in m.tool_calls %}
<tool_call>
{"name": "{{ tc.function.name }}", "arguments": {{ tc.function.arguments | tojson }}}
</tool_call>
{% endfor %}</turn><|im_end|>
{% else %}<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endif %}
{% endfor %}"""


def make(max_calls: int | None = None) -> ToolCallParser:
    return ToolCallParser(NAMES, False, max_calls)


def test_the_template_calls_read_back() -> None:
    check_round_trips(make, TEMPLATE)


def test_a_malformed_block_stays_content_and_later_blocks_still_count() -> None:
    good = render(TEMPLATE, [WEATHER_CALL])
    bad = '<tool_call>{"name": "get_weather", "arguments": {"city": }</tool_call>'
    assert read(make, bad + "\n" + good) == (bad, [WEATHER_CALL])


def test_partial_tags_are_held_back_while_streaming() -> None:
    reader = make()
    assert reader.feed("Checking <tool_") == ["Checking"]
    assert reader.feed("cal") == []
    assert reader.feed("x> done") == [" <tool_calx> done"]
    assert reader.finish() == []

"""What the tool-format tests share: tools, a conversation, a jinja renderer like the one
chat templates run in, and the check that a reader gives the same events whether the output
comes whole or a character at a time.

Each format's test writes a small chat template of its own in that family's convention (how it
renders an assistant turn's `tool_calls`), renders the conversation with it, cuts out the
assistant turn — exactly what a model trained on the template writes — and reads it back.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Any

import jinja2

from cluster.ingress.tool_formats import ToolCall, ToolCallReader

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string"},
        "unit": {"type": "string", "enum": ["c", "f"]},
        "days": {"type": "integer"},
    },
    "required": ["city"],
}
SEARCH = {
    "type": "object",
    "properties": {
        "query": {"type": "string"},
        "limit": {"type": "integer"},
        "score": {"type": "number"},
        "exact": {"type": "boolean"},
        "filters": {"type": "object"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "code": {"type": "string"},
    },
}
PARAMETERS: dict[str, Mapping[str, Any]] = {"get_weather": WEATHER, "search": SEARCH}
NAMES = frozenset(PARAMETERS)
TOOLS = [
    {"type": "function", "function": {"name": n, "description": n, "parameters": p}}
    for n, p in PARAMETERS.items()
]

WEATHER_CALL = ("get_weather", {"city": "Paris", "unit": "c", "days": 3})
SEARCH_CALL = (
    "search",
    {
        "query": 'caf\u00e9 "noir"; {braces} [brackets] <tags>',
        "limit": 5,
        "score": 0.5,
        "exact": True,
        "filters": {"lang": "fr", "year": [2023, 2024], "open": False},
        "tags": ["a", "b"],
    },
)
UNKNOWN_CALL = ("launch_rockets", {"count": 1})

Calls = list[tuple[str, dict[str, Any]]]


def _tojson(value: Any, indent: int | None = None) -> str:
    # As Hugging Face's chat-template environment does it: plain JSON, not HTML-escaped.
    return json.dumps(value, ensure_ascii=False, indent=indent)


def render(template: str, calls: Calls, content: str = "") -> str:
    """The assistant turn `template` renders for `calls` (between `<turn>` and `</turn>`,
    which the test templates put around each assistant turn)."""
    env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = _tojson
    tool_calls = [
        {"id": f"c{i:08d}", "type": "function", "function": {"name": n, "arguments": a}}
        for i, (n, a) in enumerate(calls)
    ]
    messages = [
        {"role": "user", "content": "Weather in Paris, and search for cafés?"},
        {"role": "assistant", "content": content, "tool_calls": tool_calls},
    ]
    text = env.from_string(template).render(messages=messages, tools=TOOLS)
    return text.split("<turn>")[-1].split("</turn>")[0]


Factory = Callable[[int | None], ToolCallReader]


def events_whole(make: Factory, text: str, max_calls: int | None = None) -> list:
    reader = make(max_calls)
    return reader.feed(text) + reader.finish()


def events_by_char(make: Factory, text: str, max_calls: int | None = None) -> list:
    reader = make(max_calls)
    out: list = []
    for ch in text:
        out += reader.feed(ch)
    return out + reader.finish()


def summary(events: list) -> tuple[str | None, Calls]:
    content = "".join(e for e in events if isinstance(e, str)) or None
    calls = [(e.name, json.loads(e.arguments)) for e in events if isinstance(e, ToolCall)]
    return content, calls


def read(make: Factory, text: str, max_calls: int | None = None) -> tuple[str | None, Calls]:
    """(content, calls) of `text`, checked to be the same fed whole and a character at a
    time (and in pieces of a few sizes); the count of calls the reader reports matches."""
    whole = summary(events_whole(make, text, max_calls))
    assert summary(events_by_char(make, text, max_calls)) == whole
    for size in (2, 3, 7):
        reader = make(max_calls)
        events: list = []
        for i in range(0, len(text), size):
            events += reader.feed(text[i : i + size])
        events += reader.finish()
        assert summary(events) == whole
        assert reader.calls == len(whole[1])
    return whole


def check_round_trips(make: Factory, template: str) -> None:
    """The calls a template renders read back exactly: with content before them, several,
    one, an unknown tool's (content, never lost), and only the first under max_calls=1."""
    text = render(template, [WEATHER_CALL, SEARCH_CALL], "Let me look that up.")
    assert read(make, text) == ("Let me look that up.", [WEATHER_CALL, SEARCH_CALL])
    text = render(template, [SEARCH_CALL, WEATHER_CALL])
    assert read(make, text) == (None, [SEARCH_CALL, WEATHER_CALL])
    assert read(make, render(template, [WEATHER_CALL])) == (None, [WEATHER_CALL])
    assert read(make, text, max_calls=1) == (None, [SEARCH_CALL])
    unknown = render(template, [UNKNOWN_CALL])
    assert read(make, unknown) == (unknown.strip(), [])
    plain = "Paris is sunny; {no call here} [really]."
    assert read(make, plain) == (plain, [])
    assert read(make, "") == (None, [])

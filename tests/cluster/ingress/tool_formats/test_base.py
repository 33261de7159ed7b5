"""The readers' shared parts (cluster/ingress/tool_formats/base.py): calls from JSON, the
bracket scanner, partial markers, and constrained output read the same in every format."""

from __future__ import annotations

import json

import pytest

from cluster.ingress.tool_formats import TOOL_CALL_FORMATS, make_tool_parser
from cluster.ingress.tool_formats.base import (
    Brackets,
    call_from_json,
    is_partial,
    make_call,
    partial_suffix,
    split_at_first,
    split_at_marker,
)
from tests.cluster.ingress.tool_formats.cases import NAMES, PARAMETERS, read


def test_calls_from_json() -> None:
    call = call_from_json('{"name": "search", "parameters": {"query": "é"}}', NAMES)
    assert call is not None and call.arguments == '{"query": "é"}'
    assert call.id.startswith("call_") and call.as_openai()["function"]["name"] == "search"
    assert call_from_json('{"name": "search", "arguments": "{\\"limit\\": 1}"}', NAMES)
    for bad in (
        '{"name": "nope", "arguments": {}}',
        '{"name": "search", "arguments": [1]}',
        '{"name": "search", "arguments": "{"}',
        "[1]",
        "{",
    ):
        assert call_from_json(bad, NAMES) is None
    assert make_call("search", {"score": float("nan")}, NAMES) is None  # not JSON


def test_brackets_resume_and_skip_strings() -> None:
    scan = Brackets()
    text = '{"a": "}]", "b": [1, {"c": "\\""}]}'
    for n in range(1, len(text)):
        assert scan.end(text[:n]) == -1
    assert scan.end(text + " tail") == len(text)
    calls = "[f(x=')]'), g(y=\"(\")]"
    assert Brackets("\"'").end(calls + " more") == len(calls)


def test_markers() -> None:
    assert partial_suffix("abc <tool", "<tool_call>") == 5
    assert partial_suffix("abc", "<tool_call>") == 0
    assert split_at_marker("a<m>b", "<m>") == ("a", "b")
    assert split_at_marker("a<", "<m>") == ("a", None)
    assert split_at_first("a<n>b<m>c", ("<m>", "<n>")) == ("a", "<n>", "b<m>c")
    assert split_at_first("ab<", ("<m>", "<nn>")) == ("ab", None, "")
    assert is_partial("<m", "<m>") and not is_partial("<m>", "<m>") and not is_partial("x", "<m>")


@pytest.mark.parametrize("fmt", TOOL_CALL_FORMATS)
def test_constrained_output_is_the_json_array_in_every_format(fmt: str) -> None:
    calls = [("get_weather", {"city": "Oslo"}), ("search", {"query": "]}"})]
    text = json.dumps([{"name": n, "arguments": a} for n, a in calls])

    def make(most: int | None) -> object:
        return make_tool_parser(fmt, NAMES, True, most, PARAMETERS)

    assert read(make, text) == (None, calls)  # type: ignore[arg-type]
    assert read(make, '[{"name": "get_weather", "argu') == ('[{"name": "get_weather", "argu', [])  # type: ignore[arg-type]

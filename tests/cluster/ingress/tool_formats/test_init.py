"""The format names and the factory (cluster/ingress/tool_formats/__init__.py), and
`parse_all`'s format argument (cluster/ingress/tool_calls.py)."""

from __future__ import annotations

import pytest

from cluster.ingress import tool_calls
from cluster.ingress.tool_formats import (
    TOOL_CALL_FORMATS,
    Llama3JsonParser,
    MistralParser,
    PythonicParser,
    Qwen3CoderParser,
    ToolCallParser,
    ToolCallReader,
    make_tool_parser,
)
from tests.cluster.ingress.tool_formats.cases import NAMES, PARAMETERS


def test_the_factory_makes_each_format() -> None:
    assert TOOL_CALL_FORMATS == (
        "auto",
        "hermes",
        "llama3_json",
        "mistral",
        "qwen3_coder",
        "pythonic",
    )
    kinds = {
        "auto": ToolCallParser,  # resolved from the chat template before; the default if not
        "hermes": ToolCallParser,
        "llama3_json": Llama3JsonParser,
        "mistral": MistralParser,
        "qwen3_coder": Qwen3CoderParser,
        "pythonic": PythonicParser,
    }
    for fmt in TOOL_CALL_FORMATS:
        reader = make_tool_parser(fmt, NAMES, False, 1, PARAMETERS)
        assert type(reader) is kinds[fmt] and isinstance(reader, ToolCallReader)
        assert reader.names == NAMES and reader.max_calls == 1 and not reader.constrained
    reader = make_tool_parser("qwen3_coder", NAMES, False, None, PARAMETERS)
    assert isinstance(reader, Qwen3CoderParser) and reader.parameters == PARAMETERS
    with pytest.raises(ValueError, match="unknown tool-call format 'xml'"):
        make_tool_parser("xml", NAMES, False)


def test_tool_calls_keeps_its_names_and_parse_all_takes_a_format() -> None:
    assert tool_calls.ToolCallParser is ToolCallParser
    assert issubclass(tool_calls.ToolCallParser, tool_calls.ToolCallReader)
    text = "Sure. [TOOL_CALLS]search[ARGS]{}"
    content, calls = tool_calls.parse_all(text, NAMES, False, format="mistral")
    assert content == "Sure." and [c.name for c in calls] == ["search"]
    assert tool_calls.parse_all(text, NAMES, False) == (text, [])  # hermes, the default
    xml = "<tool_call>\n<function=search>\n<parameter=limit>\n2\n</parameter>\n</function>\n"
    xml += "</tool_call>"
    _, calls = tool_calls.parse_all(xml, NAMES, False, format="qwen3_coder", parameters=PARAMETERS)
    assert calls[0].arguments == '{"limit": 2}'

"""Tool calls read from the model's output, whole or as it streams, for both ingresses.

With tool_choice "auto" the model writes calls in its own format between ordinary text (the
chat template's convention: Hermes / Qwen `<tool_call>{"name": ..., "arguments": {...}}
</tool_call>` blocks by default; the other formats are in cluster/ingress/tool_formats/); with
"required" or a named function its output is constrained to a JSON array of
`{"name", "arguments"}` objects (see cluster/ingress/tools.py). A reader takes either
incrementally: `feed` takes each new piece of text and returns what became certain — content
text and whole calls — and `finish` flushes the rest. A non-streamed answer is one `feed` of
the whole text, so both paths give the same calls. Text that is not a valid call stays in the
content, never lost.

This module is what the ingresses import: the call type, the readers' shared interface
(`ToolCallReader`), the Hermes reader (`ToolCallParser`), and the helpers below.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

from cluster.ingress.tool_formats import make_tool_parser
from cluster.ingress.tool_formats.base import Event, ToolCall, ToolCallReader, call_from_json
from cluster.ingress.tool_formats.hermes import CLOSE, OPEN, ToolCallParser

__all__ = [
    "CLOSE",
    "OPEN",
    "Event",
    "ToolCall",
    "ToolCallParser",
    "ToolCallReader",
    "call_from_json",
    "finish_reason",
    "parse_all",
]


def parse_all(
    text: str,
    names: Collection[str],
    constrained: bool,
    max_calls: int | None = None,
    format: str = "hermes",
    parameters: Mapping[str, Mapping[str, Any]] | None = None,
) -> tuple[str | None, list[ToolCall]]:
    """(content or None, calls) of a whole output written in `format`."""
    parser = make_tool_parser(format, names, constrained, max_calls, parameters)
    events = parser.feed(text) + parser.finish()
    calls = [e for e in events if isinstance(e, ToolCall)]
    content = "".join(e for e in events if isinstance(e, str))
    return (content or None), calls


def finish_reason(reason: str | None, calls: int) -> str | None:
    """OpenAI's "tool_calls" for a choice that ended normally with calls."""
    return "tool_calls" if reason == "stop" and calls else reason

"""Tool-call formats: how a model writes calls into its output, one reader per format.

The names are vLLM's `--tool-call-parser` names, which users already know:

- `hermes`: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (Hermes, Qwen 2.5 / 3).
- `llama3_json`: `{"name": ..., "parameters": {...}}` objects, `;`-separated, optionally after
  `<|python_tag|>` (Llama 3.1 / 3.2 / 4).
- `mistral`: `[TOOL_CALLS]` then a JSON array of calls, or `name[ARGS]{...}` per call.
- `qwen3_coder`: `<tool_call><function=NAME><parameter=KEY>VALUE</parameter></function>`
  (Qwen3-Coder); values converted by the tools' parameter schemas.
- `pythonic`: `[get_weather(city="Paris"), ...]` (Llama 3.2 / Llama 4 pythonic).
- `auto`: the format the chat template teaches (`detect_tool_format`).

Every reader has one interface (`ToolCallReader`): `feed` / `finish` give content text and
whole calls, the same ones whether the output comes whole or a character at a time. Forced
calls (tool_choice "required" / named) are written in the format itself where a grammar can
hold it (grammars.py: hermes, llama3_json) and read as unforced ones; in the other formats
they are the JSON array of calls, read by every reader's constrained mode.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

from cluster.ingress.tool_formats.base import Event, ToolCall, ToolCallReader, call_from_json
from cluster.ingress.tool_formats.detect import detect_tool_format
from cluster.ingress.tool_formats.hermes import ToolCallParser
from cluster.ingress.tool_formats.llama3_json import Llama3JsonParser
from cluster.ingress.tool_formats.mistral import MistralParser
from cluster.ingress.tool_formats.pythonic import PythonicParser
from cluster.ingress.tool_formats.qwen3_coder import Qwen3CoderParser

TOOL_CALL_FORMATS = ("auto", "hermes", "llama3_json", "mistral", "qwen3_coder", "pythonic")

_READERS: dict[str, type[ToolCallReader]] = {
    "hermes": ToolCallParser,
    "llama3_json": Llama3JsonParser,
    "mistral": MistralParser,
    "pythonic": PythonicParser,
}


def make_tool_parser(
    format: str,
    names: Collection[str],
    constrained: bool,
    max_calls: int | None = None,
    parameters: Mapping[str, Mapping[str, Any]] | None = None,
) -> ToolCallReader:
    """A reader of one choice's output in `format`. `parameters` maps tool names to their
    parameters schemas (qwen3_coder converts values by them). "auto" should be resolved
    from the chat template with `detect_tool_format` beforehand; unresolved, it reads the
    default format, hermes."""
    if format == "qwen3_coder":
        return Qwen3CoderParser(names, constrained, max_calls, parameters)
    if format == "auto":
        format = "hermes"
    reader = _READERS.get(format)
    if reader is None:
        known = ", ".join(TOOL_CALL_FORMATS)
        raise ValueError(f"unknown tool-call format {format!r}; expected one of {known}")
    return reader(names, constrained, max_calls)


__all__ = [
    "TOOL_CALL_FORMATS",
    "Event",
    "Llama3JsonParser",
    "MistralParser",
    "PythonicParser",
    "Qwen3CoderParser",
    "ToolCall",
    "ToolCallParser",
    "ToolCallReader",
    "call_from_json",
    "detect_tool_format",
    "make_tool_parser",
]

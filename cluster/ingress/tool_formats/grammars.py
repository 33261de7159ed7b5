"""Grammars that hold forced tool calls (tool_choice "required" or a named function) to the
format the model was trained to write them in, where a grammar around a JSON object can say
it: `hermes` (`<tool_call>` blocks) and `llama3_json` (`;`-separated objects). A model kept to
its own format writes better arguments than one pushed into a shape it never saw.

The other formats (mistral's `[TOOL_CALLS]` special token, qwen3_coder's typed XML values,
pythonic's Python literals) are held to the JSON array of calls every reader reads in its
constrained mode (cluster/ingress/tools.py `calls_schema`), as vLLM does for every format.

The grammars are llguidance Lark with each call object as an embedded JSON schema (`%json`),
generated compact like every JSON the engine constrains.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

# As the engine's JSON schemas (workers/structured/backend.py): no optional whitespace.
_JSON_STYLE = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}

# format -> (before a call, after it, between two calls, the arguments' key)
_SHAPES: dict[str, tuple[str, str, str, str]] = {
    "hermes": ("<tool_call>\n", "\n</tool_call>", "\n", "arguments"),
    "llama3_json": ("", "", "; ", "parameters"),
}


def has_call_grammar(format: str) -> bool:
    """Whether forced calls in `format` are written in the format itself (else the array)."""
    return format in _SHAPES


def arguments_key(format: str) -> str:
    """The key of a call object's arguments in `format`'s grammar."""
    return _SHAPES[format][3]


def call_grammar(format: str, calls: Sequence[dict[str, Any]], one: bool) -> str:
    """The Lark grammar of one (`one`) or more calls in `format`; `calls` are the JSON schemas
    of the call objects, one per tool that may be called (keyed by `arguments_key`)."""
    before, after, between, _ = _SHAPES[format]
    schema: dict[str, Any] = calls[0] if len(calls) == 1 else {"anyOf": list(calls)}
    schema = {**schema, "x-guidance": _JSON_STYLE}
    call = " ".join(part for part in (_literal(before), "obj", _literal(after)) if part)
    start = "call" if one else f"call ({_literal(between)} call)*"
    return f"start: {start}\ncall: {call}\nobj: %json {json.dumps(schema)}\n"


def _literal(text: str) -> str:
    """A Lark string literal (JSON's escapes are Lark's)."""
    return json.dumps(text) if text else ""

"""Qwen3-Coder tool calls (vLLM's `qwen3_coder`): XML inside the `<tool_call>` tags,

    <tool_call>
    <function=NAME>
    <parameter=KEY>
    VALUE
    </parameter>
    </function>
    </tool_call>

so code can be passed without JSON escapes. A value is text: the tool's declared parameter
schema says what JSON it stands for (integer, number, boolean, null, object, array parsed from
the text; strings kept as written). A parameter the schema does not declare stays a string,
as the model's template wrote it. A body in Hermes' JSON form is read too (Qwen3 models that
are not Coder share these tags).
"""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Collection, Mapping
from typing import Any

from cluster.ingress.tool_formats.base import ToolCall, call_from_json, make_call
from cluster.ingress.tool_formats.hermes import ToolCallParser

_FUNCTION = re.compile(r"<function=([^>\n]+)>(.*)</function>", re.DOTALL)
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.DOTALL)
_SCALARS = ("integer", "number", "boolean", "null")


class Qwen3CoderParser(ToolCallParser):
    """Reads `<tool_call>` blocks in Qwen3-Coder's XML form; `parameters` maps each tool's name
    to its parameters schema (what the values are converted by)."""

    def __init__(
        self,
        names: Collection[str],
        constrained: bool,
        max_calls: int | None = None,
        parameters: Mapping[str, Mapping[str, Any]] | None = None,
    ) -> None:
        super().__init__(names, constrained, max_calls)
        self.parameters = dict(parameters or {})

    def _call(self, body: str) -> ToolCall | None:
        body = body.strip()
        if body.startswith("{"):
            return call_from_json(body, self.names)
        function = _FUNCTION.fullmatch(body)
        if function is None:
            return None
        name = function.group(1).strip()
        if name not in self.names:
            return None
        args = _arguments(function.group(2), self.parameters.get(name) or {})
        return None if args is None else make_call(name, args, self.names)


def _arguments(text: str, schema: Mapping[str, Any]) -> dict[str, Any] | None:
    """The parameters in `text` (nothing else but whitespace between them), or None."""
    properties = schema.get("properties")
    if not isinstance(properties, Mapping):
        properties = {}
    args: dict[str, Any] = {}
    at = 0
    while True:
        while at < len(text) and text[at].isspace():
            at += 1
        if at == len(text):
            return args
        param = _PARAMETER.match(text, at)
        if param is None:
            return None
        key = param.group(1).strip()
        value = param.group(2)
        # The template puts each value on lines of its own: those two newlines are layout.
        value = value[1:] if value.startswith("\n") else value
        value = value[:-1] if value.endswith("\n") else value
        args[key] = convert(value, properties.get(key))
        at = param.end()


def convert(text: str, schema: Any) -> Any:
    """The JSON value parameter text stands for, by its schema; text that does not parse as
    the declared type stays a string (the arguments are the model's, right or wrong)."""
    kinds = _types(schema)
    if not kinds or "string" in kinds:
        return text
    value = text.strip()
    for kind in kinds:
        if kind == "null" and value.lower() in ("null", "none"):
            return None
        if kind == "boolean" and value.lower() in ("true", "false"):
            return value.lower() == "true"
        if kind in ("integer", "number"):
            try:
                number = json.loads(value)
            except json.JSONDecodeError:
                continue
            if isinstance(number, int | float) and not isinstance(number, bool):
                if kind == "number" or isinstance(number, int) or number.is_integer():
                    return int(number) if kind == "integer" else number
        if kind in ("object", "array"):
            parsed = _structure(value)
            if isinstance(parsed, dict if kind == "object" else list):
                return parsed
    if not set(kinds) & set(_SCALARS + ("object", "array")):
        parsed = _structure(value)  # a type we do not know: JSON if it is JSON
        if parsed is not _NOT:
            return parsed
    return text


_NOT = object()  # text that is neither JSON nor a Python literal


def _structure(text: str) -> Any:
    """JSON text, or a Python literal (a model may write `{'a': True}`); never evaluated."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        pass
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return _NOT
    try:  # only what JSON can carry (no sets, bytes, complex numbers)
        return json.loads(json.dumps(value, allow_nan=False))
    except (TypeError, ValueError):
        return _NOT


def _types(schema: Any) -> list[str]:
    """The JSON types a property schema allows, in order ("type", or its anyOf / oneOf)."""
    if not isinstance(schema, Mapping):
        return []
    kind = schema.get("type")
    if isinstance(kind, str):
        return [kind]
    if isinstance(kind, list):
        return [k for k in kind if isinstance(k, str)]
    out: list[str] = []
    for key in ("anyOf", "oneOf"):
        for option in schema.get(key) or ():
            out += [k for k in _types(option) if k not in out]
    if not out and "enum" in schema:
        return ["string"] if all(isinstance(v, str) for v in schema["enum"]) else []
    return out

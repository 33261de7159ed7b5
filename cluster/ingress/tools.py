"""OpenAI tools and tool_choice, checked at the ingress, and the constraint they imply.

`tool_choice` "auto" lets the model choose: its output is read by the reader of the
deployment's tool-call format (cluster/ingress/tool_formats/), the convention the chat
template teaches the model (Hermes / Qwen: `<tool_call>{"name": ..., "arguments": {...}}
</tool_call>`). "required" and a named function constrain the output with a grammar built
from the tools' parameters, with at least one call (exactly one when `parallel_tool_calls` is
false, or for a named function), so even a weak model returns calls whose arguments
validate: calls in the format itself where a grammar can hold it (tool_formats/grammars.py),
else a JSON array of call objects `{"name": ..., "arguments": {...}}`. Arguments hold the
declared parameters only, unless a tool's schema sets `additionalProperties` itself. "none"
leaves the output alone.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from cluster.errors import InvalidRequestError
from cluster.ingress.structured import Constraint, grammar_constraint, schema_constraint
from cluster.ingress.tool_calls import ToolCallParser
from cluster.ingress.tool_formats import make_tool_parser
from cluster.ingress.tool_formats.grammars import arguments_key, call_grammar, has_call_grammar

MAX_TOOLS = 128
_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")
_MODES = ("none", "auto", "required")
# The parameters of a function that declares none: an object with any (or no) members.
EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class Tool:
    """One function the model may call."""

    name: str
    description: str
    parameters: Mapping[str, Any]  # a JSON schema of the arguments object

    def as_template_input(self) -> dict[str, Any]:
        """The OpenAI tool dict chat templates expect."""
        fn: dict[str, Any] = {"name": self.name, "parameters": dict(self.parameters)}
        if self.description:
            fn["description"] = self.description
        return {"type": "function", "function": fn}


@dataclass(frozen=True)
class ToolChoice:
    """What the model may do with the tools: mode none | auto | required | named."""

    mode: str
    name: str | None = None  # the function, when mode is "named"

    @property
    def constrained(self) -> bool:
        return self.mode in ("required", "named")


@dataclass(frozen=True)
class ToolUse:
    """A chat request's tools, after the checks: what to render and how to read the output."""

    tools: tuple[Tool, ...]
    choice: ToolChoice
    parallel: bool = True
    # How the model writes calls (cluster/ingress/tool_formats/): the deployment's resolved
    # tool_call_parser, set by the Preparer (cluster/ingress/prepare.py). None: not known
    # (a ToolUse read outside a deployment): calls read as hermes, forced ones as the array.
    format: str | None = None

    @property
    def parses(self) -> bool:
        """Whether the output is read for tool calls (not with tool_choice none)."""
        return bool(self.tools) and self.choice.mode != "none"

    def template_tools(self) -> list[dict[str, Any]] | None:
        return [t.as_template_input() for t in self.tools] or None

    def names(self) -> frozenset[str]:
        return frozenset(t.name for t in self.tools)

    def parser(self) -> ToolCallParser:
        """A reader of one choice's output for this request's calls."""
        most = None if self.parallel and self.choice.mode != "named" else 1
        parameters = {t.name: t.parameters for t in self.tools}
        # Forced calls held to the format's own grammar read as the format's unforced ones.
        fmt = self.format or "hermes"
        array = self.choice.constrained and (self.format is None or not has_call_grammar(fmt))
        return make_tool_parser(fmt, self.names(), array, most, parameters)

    def parameter_constraints(self, field_of: Callable[[int], str]) -> list[Constraint]:
        """Each tool's parameters as a constraint, named `field_of(i)`: the ingress checks
        them all (whatever tool_choice is), so a bad schema is a 400 naming its tool."""
        return [
            schema_constraint(dict(t.parameters), field_of(i)) for i, t in enumerate(self.tools)
        ]

    def constraint(self, field: str = "tools") -> Constraint | None:
        """The constraint of "required" / a named function, else None: the calls in the
        format's own shape where it has a grammar (cluster/ingress/tool_formats/grammars.py),
        else the JSON array of calls; `field` is what an error names (where the request holds
        the tools)."""
        if not self.choice.constrained:
            return None
        if self.format is None or not has_call_grammar(self.format):
            return schema_constraint(calls_schema(self), field)
        objects = call_objects(self, arguments_key(self.format))
        one = self.choice.mode == "named" or not self.parallel
        return grammar_constraint(call_grammar(self.format, objects, one), field)


def parse_tools(tools: Sequence[Any] | None, field: str = "tools") -> tuple[Tool, ...]:
    """OpenAI `tools` ([{"type": "function", "function": {name, description, parameters}}])."""
    if tools is None:
        return ()
    if not isinstance(tools, Sequence) or isinstance(tools, (str, bytes)):
        raise InvalidRequestError(field, f"{field} must be a list of tools")
    if len(tools) > MAX_TOOLS:
        raise InvalidRequestError(
            field, f"{field} has {len(tools)} tools; at most {MAX_TOOLS} are allowed"
        )
    out: list[Tool] = []
    seen: set[str] = set()
    for i, t in enumerate(tools):
        where = f"{field}[{i}]"
        if not isinstance(t, Mapping) or t.get("type", "function") != "function":
            raise InvalidRequestError(f"{where}.type", f"{where} must be a function tool")
        fn = t.get("function")
        if not isinstance(fn, Mapping):
            raise InvalidRequestError(f"{where}.function", f"{where}.function must be an object")
        tool = _tool(fn, f"{where}.function")
        if tool.name in seen:
            raise InvalidRequestError(
                f"{where}.function.name", f"{where}.function.name {tool.name!r} is a duplicate"
            )
        seen.add(tool.name)
        out.append(tool)
    return tuple(out)


def make_tool(name: Any, description: Any, parameters: Any, where: str) -> Tool:
    """One checked Tool; errors name `where`.name, .description, .parameters."""
    if not isinstance(name, str) or not _NAME.match(name):
        raise InvalidRequestError(
            f"{where}.name",
            f"{where}.name must be 1-64 letters, digits, '_', '-' or '.'; got {name!r}",
        )
    if description is None:
        description = ""
    if not isinstance(description, str):
        raise InvalidRequestError(f"{where}.description", f"{where}.description must be a string")
    if parameters is None:
        parameters = EMPTY_PARAMETERS
    if not isinstance(parameters, Mapping):
        raise InvalidRequestError(
            f"{where}.parameters", f"{where}.parameters must be a JSON schema object"
        )
    kind = parameters.get("type", "object")
    if kind != "object":
        raise InvalidRequestError(
            f"{where}.parameters",
            f"{where}.parameters must describe an object (type 'object'), got type {kind!r}",
        )
    return Tool(name, description, parameters)


def _tool(fn: Mapping[str, Any], where: str) -> Tool:
    return make_tool(fn.get("name"), fn.get("description"), fn.get("parameters"), where)


def parse_tool_choice(value: Any, tools: Sequence[Tool], field: str = "tool_choice") -> ToolChoice:
    """OpenAI `tool_choice`: "none" | "auto" | "required" | {"type": "function",
    "function": {"name": ...}}; unset is "auto" with tools, "none" without."""
    if value is None:
        return ToolChoice("auto" if tools else "none")
    if isinstance(value, str):
        if value not in _MODES:
            raise InvalidRequestError(
                field, f"{field} must be one of {', '.join(_MODES)} or a named function"
            )
        mode = value
        name = None
    elif isinstance(value, Mapping):
        fn = value.get("function")
        name = fn.get("name") if isinstance(fn, Mapping) else None
        if value.get("type", "function") != "function" or not isinstance(name, str):
            raise InvalidRequestError(
                field, f'{field} must be {{"type": "function", "function": {{"name": ...}}}}'
            )
        mode = "named"
    else:
        raise InvalidRequestError(field, f"{field} must be a string or an object")
    return make_choice(mode, name, tools, field, f"{field}.function.name")


def make_choice(
    mode: str, name: str | None, tools: Sequence[Tool], field: str, name_field: str
) -> ToolChoice:
    """A checked ToolChoice: required and named need tools; a named one must be a tool."""
    if mode in ("required", "named") and not tools:
        raise InvalidRequestError(field, f"{field} {mode!r} needs tools")
    if mode == "named" and name not in {t.name for t in tools}:
        known = ", ".join(t.name for t in tools)
        raise InvalidRequestError(
            name_field, f"{name_field} {name!r} is not one of the tools ({known})"
        )
    return ToolChoice(mode, name)


def tool_use(
    tools: Sequence[Any] | None, tool_choice: Any, parallel_tool_calls: bool | None
) -> ToolUse | None:
    """A chat request's checked tools (None without tools and without a tool_choice)."""
    parsed = parse_tools(tools)
    choice = parse_tool_choice(tool_choice, parsed)
    if not parsed:
        return None
    return ToolUse(parsed, choice, parallel_tool_calls is not False)


def call_objects(use: ToolUse, key: str = "arguments") -> list[dict[str, Any]]:
    """The JSON schema of one call object per tool the request may call: {"name", `key`}."""
    tools = [t for t in use.tools if use.choice.mode != "named" or t.name == use.choice.name]
    return [
        {
            "type": "object",
            "properties": {"name": {"const": t.name}, key: _closed(t.parameters)},
            "required": ["name", key],
            "additionalProperties": False,
        }
        for t in tools
    ]


def calls_schema(use: ToolUse) -> dict[str, Any]:
    """The JSON schema of the constrained output: an array of {"name", "arguments"} calls."""
    calls = call_objects(use)
    items = calls[0] if len(calls) == 1 else {"anyOf": calls}
    schema: dict[str, Any] = {"type": "array", "items": items, "minItems": 1}
    if use.choice.mode == "named" or not use.parallel:
        schema["maxItems"] = 1
    return schema


def template_tool_calls(calls: Sequence[Any], field: str = "messages") -> list[dict[str, Any]]:
    """An assistant message's OpenAI `tool_calls` as chat templates take them: arguments as a
    dict (OpenAI sends JSON text; templates write `arguments | tojson`)."""
    out = []
    for call in calls:
        fn = call.get("function") if isinstance(call, Mapping) else None
        if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
            raise InvalidRequestError(
                field, f"{field}: each tool_calls entry needs function.name and arguments"
            )
        args: Any = fn.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except json.JSONDecodeError:
                pass  # kept as the text the model wrote; the template writes it as it is
        entry = {"type": "function", "function": {"name": fn["name"], "arguments": args}}
        if isinstance(call.get("id"), str):
            entry["id"] = call["id"]
        out.append(entry)
    return out


def _closed(parameters: Mapping[str, Any]) -> dict[str, Any]:
    """The arguments schema of a constrained call: the declared parameters only, unless the
    tool says otherwise. An open object would let a weak model invent keys until max_tokens;
    whatever the closed schema accepts, the tool's own accepts too."""
    args = dict(parameters)
    args.setdefault("additionalProperties", False)
    return args

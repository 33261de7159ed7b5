"""A Responses API request's `input`, `tools`, `tool_choice` and `text.format`, read into what
the chat path takes: template messages, a checked `ToolUse` and an output `Constraint`.

`input` is a string (one user message) or a list of items: messages (role user, system,
developer or assistant; content a string or `input_text` / `output_text` parts), and the two
halves of a tool round-trip — `function_call` items (what the model called, as a previous
response returned them) and `function_call_output` items (what the caller's function gave
back). Consecutive calls join the assistant turn before them, as one chat assistant message
with `tool_calls`; an output becomes a `tool` message answering its `call_id`. `reasoning`
items (an earlier response's thinking, sent back as clients do) are dropped: chat templates
leave earlier turns' reasoning out of the prompt too. Anything else (images, files, item
references, built-in tools' items) is a 400 naming where it is, since dropping it would
answer a different conversation than the one sent.

Responses tools are flat (`{"type": "function", "name", "parameters", ...}`, not chat's
nested `function` object) and `tool_choice` names its function as `{"type": "function",
"name"}`; the checks and the constraint they imply are chat's (cluster/ingress/tools.py).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from cluster.errors import InvalidRequestError
from cluster.ingress import structured
from cluster.ingress.structured import Constraint
from cluster.ingress.tools import (
    MAX_TOOLS,
    Tool,
    ToolUse,
    make_choice,
    make_tool,
    template_tool_calls,
)
from workers.structured import StructuredOutputs

ROLES = ("user", "system", "developer", "assistant")
TEXT_PARTS = ("input_text", "output_text")
# Keys a function tool may carry; others (defer_loading, allowed_callers, ...) ask for more.
TOOL_KEYS = frozenset({"type", "name", "description", "parameters", "strict"})
TOOL_CHOICE_MODES = ("none", "auto", "required")


def input_messages(value: str | Sequence[Any], instructions: str | None) -> list[dict[str, Any]]:
    """The chat template's messages: `instructions` as a system message first, then `input`."""
    out: list[dict[str, Any]] = []
    if instructions:
        out.append({"role": "system", "content": instructions})
    if isinstance(value, str):
        out.append({"role": "user", "content": value})
        return out
    if not value:
        raise InvalidRequestError("input", "input must not be an empty list")
    names: dict[str, str] = {}  # call_id -> function name, for the tool messages answering it
    for i, item in enumerate(value):
        where = f"input[{i}]"
        if not isinstance(item, Mapping):
            raise InvalidRequestError(where, f"{where} must be an object")
        kind = item.get("type", "message")
        if kind == "message":
            out.append(_message(item, where))
        elif kind == "function_call":
            call = _function_call(item, where)
            names[call["id"]] = call["function"]["name"]
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "reasoning":
            continue  # earlier turns' thinking is not part of the prompt (module doc)
        elif kind == "function_call_output":
            call_id = _string(item, "call_id", where)
            tool = {"role": "tool", "tool_call_id": call_id, "content": _output(item, where)}
            if call_id in names:
                tool["name"] = names[call_id]
            out.append(tool)
        else:
            hint = (
                " (kvray stores no responses: send the items themselves)"
                if kind == "item_reference"
                else ""
            )
            raise InvalidRequestError(
                f"{where}.type",
                f"{where}.type {kind!r} is not supported; use message, function_call, "
                f"function_call_output or reasoning items{hint}",
            )
    if not out:  # reasoning items alone: nothing for the model to answer
        raise InvalidRequestError("input", "input holds no message or function call items")
    return out


def _string(item: Mapping[str, Any], key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise InvalidRequestError(f"{where}.{key}", f"{where}.{key} must be a string")
    return value


def _message(item: Mapping[str, Any], where: str) -> dict[str, Any]:
    role = item.get("role")
    if role not in ROLES:
        raise InvalidRequestError(
            f"{where}.role", f"{where}.role must be one of {', '.join(ROLES)}; got {role!r}"
        )
    return {"role": role, "content": _text(item.get("content"), f"{where}.content")}


def _text(content: Any, where: str) -> str:
    """A content string, or the text of its input_text / output_text parts, joined."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidRequestError(where, f"{where} must be a string or a list of content parts")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, Mapping) else None
        if kind not in TEXT_PARTS:
            raise InvalidRequestError(
                f"{where}[{j}].type",
                f"{where}[{j}].type {kind!r} is not supported; only text parts "
                f"({', '.join(TEXT_PARTS)}) are",
            )
        texts.append(_string(part, "text", f"{where}[{j}]"))
    return "".join(texts)


def _function_call(item: Mapping[str, Any], where: str) -> dict[str, Any]:
    """A function_call item as a chat assistant message's tool call (arguments as the dict
    templates write: cluster/ingress/tools.py template_tool_calls)."""
    call_id = _string(item, "call_id", where)
    name = _string(item, "name", where)
    arguments = _string(item, "arguments", where)
    chat_call = {"id": call_id, "function": {"name": name, "arguments": arguments}}
    return template_tool_calls([chat_call], where)[0]


def _output(item: Mapping[str, Any], where: str) -> str:
    return _text(item.get("output"), f"{where}.output")


# -- tools ------------------------------------------------------------------------------------


def parse_tools(tools: Sequence[Any] | None) -> tuple[Tool, ...]:
    """Responses function tools; built-in tools (web_search, file_search, ...) are a 400."""
    if not tools:
        return ()
    if len(tools) > MAX_TOOLS:
        raise InvalidRequestError(
            "tools", f"tools has {len(tools)} tools; at most {MAX_TOOLS} are allowed"
        )
    out: list[Tool] = []
    for i, t in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(t, Mapping):
            raise InvalidRequestError(where, f"{where} must be an object")
        kind = t.get("type")
        if kind != "function":
            raise InvalidRequestError(
                f"{where}.type",
                f"{where}.type {kind!r} is not supported: kvray serves function tools only",
            )
        extra = sorted(set(t) - TOOL_KEYS)
        if extra:
            raise InvalidRequestError(
                f"{where}.{extra[0]}", f"{where}.{extra[0]} is not supported on function tools"
            )
        strict = t.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise InvalidRequestError(f"{where}.strict", f"{where}.strict must be a boolean")
        tool = make_tool(t.get("name"), t.get("description"), t.get("parameters"), where)
        if any(tool.name == seen.name for seen in out):
            raise InvalidRequestError(f"{where}.name", f"{where}.name {tool.name!r} is a duplicate")
        out.append(tool)
    return tuple(out)


def tool_use(tools: Sequence[Any] | None, choice: Any, parallel: bool | None) -> ToolUse | None:
    """The checked tools and tool_choice (None without tools); chat's ToolUse, so the output
    is read for calls and constrained exactly as a chat request's is."""
    parsed = parse_tools(tools)
    if choice is None:
        mode, name = ("auto" if parsed else "none"), None
    elif isinstance(choice, str):
        if choice not in TOOL_CHOICE_MODES:
            raise InvalidRequestError(
                "tool_choice",
                f"tool_choice must be one of {', '.join(TOOL_CHOICE_MODES)} or "
                '{"type": "function", "name": ...}',
            )
        mode, name = choice, None
    elif isinstance(choice, Mapping) and choice.get("type") == "function":
        name = choice.get("name")
        if not isinstance(name, str):
            raise InvalidRequestError("tool_choice.name", "tool_choice.name must be a string")
        mode = "named"
    else:
        kind = choice.get("type") if isinstance(choice, Mapping) else type(choice).__name__
        raise InvalidRequestError(
            "tool_choice",
            f"tool_choice {kind!r} is not supported; use none, auto, required or "
            '{"type": "function", "name": ...}',
        )
    checked = make_choice(mode, name, parsed, "tool_choice", "tool_choice.name")
    if not parsed:
        return None
    return ToolUse(parsed, checked, parallel is not False)


def as_response_tool(tool: Tool, strict: bool | None) -> dict[str, Any]:
    """A checked tool as the response echoes it (OpenAI's FunctionTool)."""
    return {
        "type": "function",
        "name": tool.name,
        "description": tool.description or None,
        "parameters": dict(tool.parameters),
        "strict": strict,
    }


# -- text.format ------------------------------------------------------------------------------


def text_format(text: Mapping[str, Any] | None) -> dict[str, Any]:
    """The request's `text.format`, checked ({"type": "text"} when unset)."""
    if text is None:
        return {"type": "text"}
    extra = sorted(k for k, v in text.items() if k != "format" and v is not None)
    if extra:
        raise InvalidRequestError(f"text.{extra[0]}", f"text.{extra[0]} is not supported")
    fmt = text.get("format")
    if fmt is None:
        return {"type": "text"}
    if not isinstance(fmt, Mapping):
        raise InvalidRequestError("text.format", "text.format must be an object")
    kind = fmt.get("type")
    if kind in ("text", "json_object"):
        return {"type": kind}
    if kind != "json_schema":
        raise InvalidRequestError(
            "text.format.type",
            f"text.format.type must be one of text, json_object, json_schema; got {kind!r}",
        )
    name = fmt.get("name")
    if not isinstance(name, str) or not name:
        raise InvalidRequestError("text.format.name", "text.format.name must be a string")
    description = fmt.get("description")
    if description is not None and not isinstance(description, str):
        raise InvalidRequestError(
            "text.format.description", "text.format.description must be a string"
        )
    strict = fmt.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise InvalidRequestError("text.format.strict", "text.format.strict must be a boolean")
    if "schema" not in fmt:
        raise InvalidRequestError("text.format.schema", "text.format.schema is required")
    return {
        "type": "json_schema",
        "name": name,
        "schema": fmt["schema"],
        "description": description,
        "strict": strict,
    }


def text_constraint(fmt: Mapping[str, Any]) -> Constraint | None:
    """The output constraint of a checked `text.format` (None for plain text)."""
    if fmt["type"] == "json_object":
        return Constraint(StructuredOutputs(json_object=True), "text.format")
    if fmt["type"] == "json_schema":
        # The output always follows the schema: `strict` only says the client wants that.
        return structured.schema_constraint(fmt["schema"], "text.format.schema")
    return None

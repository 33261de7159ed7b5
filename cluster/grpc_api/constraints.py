"""kvray.v1 output constraints and tools -> the shared ingress types (cluster/ingress/).

`SamplingParams.structured_outputs` (a oneof: json_schema, json_object, regex, choice,
grammar) and `ChatMessages.tools` / `tool_choice` / `parallel_tool_calls` become the same
`Constraint` and `ToolUse` the HTTP API builds, with errors naming the field where the
client set it (`sampling.regex`, `chat.tools[0].parameters_json`, `chat.tool_choice`).
"""

from __future__ import annotations

import json
from typing import Any

from cluster.errors import InvalidRequestError
from cluster.ingress import structured, tools
from cluster.ingress.structured import Constraint
from kvray.v1 import llm_pb2
from workers.structured import StructuredOutputs

_MODES = {
    llm_pb2.TOOL_CHOICE_MODE_AUTO: "auto",
    llm_pb2.TOOL_CHOICE_MODE_NONE: "none",
    llm_pb2.TOOL_CHOICE_MODE_REQUIRED: "required",
}


def sampling_constraint(sp: llm_pb2.SamplingParams) -> Constraint | None:
    """The sampling oneof's constraint (the tool calls' is ToolUse.constraint("chat.tools"));
    cluster/ingress/prepare.py reads both, once each, and allows one."""
    kind = sp.WhichOneof("structured_outputs")
    if kind is None:
        return None
    field = f"sampling.{kind}"
    if kind == "json_schema":
        return structured.schema_text_constraint(sp.json_schema, field)
    if kind == "json_object":
        return Constraint(StructuredOutputs(json_object=True), field) if sp.json_object else None
    if kind == "choice":
        return structured.value_constraint(field, "choice", list(sp.choice.values))
    return structured.value_constraint(field, kind, getattr(sp, kind))


def tool_use(chat: llm_pb2.ChatMessages) -> tools.ToolUse | None:
    """The chat's checked tools and tool_choice (None without tools)."""
    if len(chat.tools) > tools.MAX_TOOLS:
        raise InvalidRequestError(
            "chat.tools",
            f"chat.tools has {len(chat.tools)} tools; at most {tools.MAX_TOOLS} are allowed",
        )
    parsed: list[tools.Tool] = []
    for i, t in enumerate(chat.tools):
        where = f"chat.tools[{i}]"
        tool = tools.make_tool(t.name, t.description, _parameters(t, where), where)
        if any(p.name == tool.name for p in parsed):
            raise InvalidRequestError(f"{where}.name", f"{where}.name {t.name!r} is a duplicate")
        parsed.append(tool)
    choice = _choice(chat, parsed)
    if not parsed:
        return None
    parallel = not chat.HasField("parallel_tool_calls") or chat.parallel_tool_calls
    return tools.ToolUse(tuple(parsed), choice, parallel)


def _parameters(t: llm_pb2.Tool, where: str) -> Any:
    if not t.parameters_json:
        return None
    field = f"{where}.parameters_json"
    if len(t.parameters_json) > structured.MAX_SCHEMA_BYTES:
        raise InvalidRequestError(
            field, f"{field} is over {structured.MAX_SCHEMA_BYTES} characters"
        )
    try:
        params = json.loads(t.parameters_json)
    except json.JSONDecodeError as err:
        raise InvalidRequestError(field, f"{field} is not valid JSON: {err}") from None
    if not isinstance(params, dict):
        raise InvalidRequestError(field, f"{field} must be a JSON schema object")
    return params


def _choice(chat: llm_pb2.ChatMessages, parsed: list[tools.Tool]) -> tools.ToolChoice:
    field = "chat.tool_choice"
    if not chat.HasField("tool_choice"):
        return tools.ToolChoice("auto" if parsed else "none")
    which = chat.tool_choice.WhichOneof("choice")
    if which == "function_name":
        name = chat.tool_choice.function_name
        return tools.make_choice("named", name, parsed, field, f"{field}.function_name")
    mode = _MODES.get(chat.tool_choice.mode) if which == "mode" else None
    if mode is None:
        mode = "auto" if parsed else "none"
    return tools.make_choice(mode, None, parsed, field, f"{field}.function_name")


def template_message(m: llm_pb2.ChatMessage) -> dict[str, Any]:
    """One ChatMessage as the chat template takes it (tool calls' arguments as objects)."""
    out: dict[str, Any] = {"role": m.role, "content": m.content}
    if m.tool_calls:
        calls = [
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in m.tool_calls
        ]
        out["tool_calls"] = tools.template_tool_calls(calls, "chat.messages")
    if m.tool_call_id:
        out["tool_call_id"] = m.tool_call_id
    return out

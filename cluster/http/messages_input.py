"""An Anthropic Messages request's `system`, `messages`, `tools` and `tool_choice`, read into
what the chat path takes: template messages and a checked `ToolUse`.

- `system`: a string or a list of text blocks -> one system message first.
- `messages`: roles `user` and `assistant`; content a string or a list of blocks.
  A user turn's `text` blocks join into one user message; each `tool_result` block becomes a
  chat `tool` message answering its `tool_use_id` (its content a string or text blocks;
  `is_error` puts "Error: " in front, as the chat template has no flag for it), in the order
  the blocks come. An assistant turn's `text` blocks are its content and its `tool_use`
  blocks its `tool_calls` (arguments as the dict templates write). `thinking` and
  `redacted_thinking` blocks of earlier assistant turns are dropped: the model never sees its
  earlier turns' reasoning (Anthropic's API drops them from the context too).
- Images, documents, server tools' blocks and anything else are a 400 naming the block
  (`messages.1.content.0.type`): kvray serves text models, and dropping a block would answer
  a different conversation than the one sent. `cache_control` and `citations` on blocks are
  accepted and ignored (prefix caching is automatic).
- `tools`: `{name, description, input_schema}` (type absent or "custom"); Anthropic's server
  tools (bash, web search, text editor, ...) are a 400. `tool_choice` `auto` | `any` |
  `tool` (with `name`) | `none` is chat's auto | required | named | none, and
  `disable_parallel_tool_use` chat's `parallel_tool_calls: false`; the grammar and parser
  are chat's (cluster/ingress/tools.py).

- `thinking`: `{"type": "enabled", "budget_tokens": N}` or `{"type": "adaptive"}` is the chat
  template variable `enable_thinking: true`, `{"type": "disabled"}` is `false` (Qwen3's
  templates read it; others ignore it). `budget_tokens` (a positive integer) bounds the
  thinking where a reasoning parser is on (the engine forces `</think>` once it is spent), and
  is ignored where none is. `display` is
  accepted; the thinking is always shown.

Errors name the field with Anthropic's dotted paths (`messages.0.content.1.tool_use_id`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from cluster.errors import InvalidRequestError
from cluster.ingress.tools import MAX_TOOLS, Tool, ToolUse, make_choice, make_tool

ROLES = ("user", "assistant")
DROPPED_BLOCKS = frozenset({"thinking", "redacted_thinking"})  # earlier turns' reasoning
CHOICES = {"auto": "auto", "any": "required", "tool": "named", "none": "none"}
THINKING = ("enabled", "adaptive", "disabled")
THINKING_DISPLAY = (None, "summarized", "omitted")


def _fail(field: str, message: str) -> InvalidRequestError:
    return InvalidRequestError(field, f"{field}: {message}")


def system_text(system: Any) -> str:
    """The system prompt: a string, or the text of a list of text blocks, joined."""
    if system is None or isinstance(system, str):
        return system or ""
    if not isinstance(system, list):
        raise _fail("system", "must be a string or a list of text blocks")
    return "".join(_text_block(b, f"system.{i}") for i, b in enumerate(system))


def _text_block(block: Any, where: str) -> str:
    if not isinstance(block, Mapping):
        raise _fail(where, "must be an object")
    kind = block.get("type")
    if kind != "text":
        raise _fail(f"{where}.type", f"unknown block type {kind!r}; only text blocks are allowed")
    text = block.get("text")
    if not isinstance(text, str):
        raise _fail(f"{where}.text", "must be a string")
    return text


def template_messages(system: Any, messages: Any) -> list[dict[str, Any]]:
    """The chat template's messages (module doc)."""
    if not isinstance(messages, list) or not messages:
        raise _fail("messages", "must be a non-empty list")
    out: list[dict[str, Any]] = []
    head = system_text(system)
    if head:
        out.append({"role": "system", "content": head})
    names: dict[str, str] = {}  # tool_use id -> tool name, for the results answering it
    for i, message in enumerate(messages):
        where = f"messages.{i}"
        if not isinstance(message, Mapping):
            raise _fail(where, "must be an object")
        role = message.get("role")
        if role not in ROLES:
            raise _fail(f"{where}.role", f"must be 'user' or 'assistant'; got {role!r}")
        content = message.get("content")
        if isinstance(content, str):
            out.append({"role": role, "content": content})
        elif not isinstance(content, list):
            raise _fail(f"{where}.content", "must be a string or a list of content blocks")
        elif role == "user":
            out.extend(_user_turn(content, f"{where}.content", names))
        else:
            out.append(_assistant_turn(content, f"{where}.content", names))
    return out


def _kind(block: Any, where: str) -> str:
    if not isinstance(block, Mapping):
        raise _fail(where, "must be an object")
    kind = block.get("type")
    if not isinstance(kind, str):
        raise _fail(f"{where}.type", "required")
    return kind


def _unknown(kind: str, where: str, allowed: str) -> InvalidRequestError:
    why = " (kvray serves text models)" if kind in ("image", "document") else ""
    return _fail(f"{where}.type", f"unknown block type {kind!r}{why}; use {allowed} blocks")


def _user_turn(blocks: Sequence[Any], where: str, names: Mapping[str, str]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    texts: list[str] = []

    def flush() -> None:
        if texts:
            out.append({"role": "user", "content": "".join(texts)})
            texts.clear()

    for j, block in enumerate(blocks):
        at = f"{where}.{j}"
        kind = _kind(block, at)
        if kind == "text":
            texts.append(_text_block(block, at))
        elif kind == "tool_result":
            flush()
            out.append(_tool_result(block, at, names))
        else:
            raise _unknown(kind, at, "text or tool_result")
    flush()
    if not out:  # an empty list of blocks: an empty user turn, as an empty string would be
        out.append({"role": "user", "content": ""})
    return out


def _tool_result(block: Mapping[str, Any], where: str, names: Mapping[str, str]) -> dict[str, Any]:
    call_id = block.get("tool_use_id")
    if not isinstance(call_id, str) or not call_id:
        raise _fail(f"{where}.tool_use_id", "must be a non-empty string")
    content = block.get("content", "")
    if isinstance(content, list):
        content = "".join(_text_block(b, f"{where}.content.{k}") for k, b in enumerate(content))
    elif not isinstance(content, str):
        raise _fail(f"{where}.content", "must be a string or a list of text blocks")
    is_error = block.get("is_error", False)
    if not isinstance(is_error, bool):
        raise _fail(f"{where}.is_error", "must be a boolean")
    if is_error:
        content = f"Error: {content}"
    tool: dict[str, Any] = {"role": "tool", "tool_call_id": call_id, "content": content}
    if call_id in names:
        tool["name"] = names[call_id]
    return tool


def _assistant_turn(blocks: Sequence[Any], where: str, names: dict[str, str]) -> dict[str, Any]:
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    for j, block in enumerate(blocks):
        at = f"{where}.{j}"
        kind = _kind(block, at)
        if kind == "text":
            texts.append(_text_block(block, at))
        elif kind == "tool_use":
            call = _tool_use(block, at)
            names[call["id"]] = call["function"]["name"]
            calls.append(call)
        elif kind not in DROPPED_BLOCKS:
            raise _unknown(kind, at, "text or tool_use")
    turn: dict[str, Any] = {"role": "assistant", "content": "".join(texts)}
    if calls:
        turn["tool_calls"] = calls
    return turn


def _tool_use(block: Mapping[str, Any], where: str) -> dict[str, Any]:
    """A tool_use block as a chat assistant message's tool call, as templates take it."""
    call_id, name = block.get("id"), block.get("name")
    if not isinstance(call_id, str) or not call_id:
        raise _fail(f"{where}.id", "must be a non-empty string")
    if not isinstance(name, str) or not name:
        raise _fail(f"{where}.name", "must be a non-empty string")
    args = block.get("input", {})
    if not isinstance(args, Mapping):
        raise _fail(f"{where}.input", "must be an object")
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": dict(args)}}


def thinking_kwargs(thinking: Any) -> dict[str, Any] | None:
    """`thinking` as chat template variables (module doc); None when unset."""
    if thinking is None:
        return None
    if not isinstance(thinking, Mapping):
        raise _fail("thinking", "must be an object")
    kind = thinking.get("type")
    if kind not in THINKING:
        raise _fail("thinking.type", f"must be one of {', '.join(THINKING)}; got {kind!r}")
    if kind == "enabled":
        budget = thinking.get("budget_tokens")
        if not isinstance(budget, int) or isinstance(budget, bool) or budget < 1:
            raise _fail("thinking.budget_tokens", "must be a positive integer")
    if thinking.get("display") not in THINKING_DISPLAY:
        raise _fail("thinking.display", "must be 'summarized' or 'omitted'")
    return {"enable_thinking": kind != "disabled"}


def thinking_budget(thinking: Any) -> int | None:
    """`thinking.budget_tokens` of an enabled `thinking` (checked by thinking_kwargs)."""
    if isinstance(thinking, Mapping) and thinking.get("type") == "enabled":
        return thinking.get("budget_tokens")
    return None


# -- tools ------------------------------------------------------------------------------------


def parse_tools(tools: Any) -> tuple[Tool, ...]:
    """Anthropic client tools as chat's Tools; a bad one is a 400 naming it."""
    if tools is None:
        return ()
    if not isinstance(tools, list):
        raise _fail("tools", "must be a list of tools")
    if len(tools) > MAX_TOOLS:
        raise _fail("tools", f"has {len(tools)} tools; at most {MAX_TOOLS} are allowed")
    out: list[Tool] = []
    for i, t in enumerate(tools):
        where = f"tools.{i}"
        if not isinstance(t, Mapping):
            raise _fail(where, "must be an object")
        kind = t.get("type", "custom")
        if kind not in (None, "custom"):
            raise _fail(
                f"{where}.type", f"{kind!r} is not supported: kvray serves client tools only"
            )
        if "input_schema" not in t:
            raise _fail(f"{where}.input_schema", "required")
        try:
            tool = make_tool(t.get("name"), t.get("description"), t.get("input_schema"), where)
        except InvalidRequestError as err:  # chat's checks call the schema `parameters`
            raise renamed_schema(err) from None
        if any(tool.name == seen.name for seen in out):
            raise _fail(f"{where}.name", f"{tool.name!r} is a duplicate")
        out.append(tool)
    return tuple(out)


def renamed_schema(err: InvalidRequestError) -> InvalidRequestError:
    """An error about a tool's `parameters` as Anthropic names the field (`input_schema`)."""
    param = err.param or ""
    if not param.endswith(".parameters"):
        return err
    field = param[: -len("parameters")] + "input_schema"
    return InvalidRequestError(field, err.message.replace(param, field))


def tool_use(tools: Any, choice: Any) -> ToolUse | None:
    """The checked tools and tool_choice (None without tools), as chat's ToolUse."""
    parsed = parse_tools(tools)
    parallel = True
    if choice is None:
        mode, name = ("auto" if parsed else "none"), None
    else:
        if not isinstance(choice, Mapping) or choice.get("type") not in CHOICES:
            raise _fail(
                "tool_choice.type", f"must be one of {', '.join(CHOICES)} (an object with type)"
            )
        mode, name = CHOICES[choice["type"]], choice.get("name")
        if mode == "named" and not isinstance(name, str):
            raise _fail("tool_choice.name", "required with type 'tool'")
        disable = choice.get("disable_parallel_tool_use", False)
        if not isinstance(disable, bool):
            raise _fail("tool_choice.disable_parallel_tool_use", "must be a boolean")
        parallel = not disable
    checked = make_choice(mode, name, parsed, "tool_choice", "tool_choice.name")
    if not parsed:
        return None
    return ToolUse(parsed, checked, parallel)


def tool_input(arguments: str) -> dict[str, Any]:
    """A parsed call's arguments (JSON object text, cluster/ingress/tool_calls.py) as a
    tool_use block's `input`."""
    value = json.loads(arguments)
    return value if isinstance(value, dict) else {}

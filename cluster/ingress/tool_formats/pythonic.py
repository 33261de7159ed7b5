"""Pythonic tool calls (vLLM's `pythonic`, Llama 3.2 / Llama 4's own form): the answer is a
Python list of calls, `[get_weather(city="Paris", unit="c"), other(x=1)]`, keyword arguments
holding literals only (strings, numbers, True / False / None, lists, dicts; JSON's true / false /
null are accepted too). Llama 4 may wrap it in `<|python_start|>` ... `<|python_end|>`.

The list is read where the output begins with `[` (after whitespace) and after a
`<|python_start|>` anywhere. It is parsed with `ast`, never evaluated, and it is all calls or,
if anything in it is not a call of a known tool with literal arguments, all content. Text that
cannot begin a call (`[1] ...`, `[a note]`) is released as content at once.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Collection
from typing import Any

from cluster.ingress.tool_formats.base import (
    Brackets,
    Event,
    ToolCall,
    ToolCallReader,
    is_partial,
    make_call,
    split_at_marker,
)

START = "<|python_start|>"
END = "<|python_end|>"
_HEAD = re.compile(r"\[\s*[A-Za-z_][\w.]*\s*")  # `[name` up to where `(` must come
_JSON_NAMES = {"true": True, "false": False, "null": None}

_START = "start"  # only whitespace so far: a `[` here opens a list of calls
_TEXT = "text"  # content; only START opens a list
_OPEN = "open"  # after START, before the `[`
_LIST = "list"  # inside the list
_AFTER = "after"  # after a list of calls: an END tag may follow


class PythonicParser(ToolCallReader):
    """Reads Python lists of calls; see the module doc."""

    def __init__(
        self, names: Collection[str], constrained: bool, max_calls: int | None = None
    ) -> None:
        super().__init__(names, constrained, max_calls)
        self._buf = ""
        self._state = _START
        self._opener = ""  # START and the whitespace after it, or "" at the output's start
        self._scan = Brackets("\"'")
        self._head = False  # the list begins like a call: `[name(`

    def _read(self, text: str) -> list[Event]:
        self._buf += text
        out: list[Event] = []
        while True:
            if self._state == _START:
                body = self._buf.lstrip()
                if not body or is_partial(body, START):
                    return out
                self._buf = body
                if body.startswith("["):
                    self._begin("")
                else:
                    self._state = _TEXT
            elif self._state == _TEXT:
                before, after = split_at_marker(self._buf, START)
                out.append(before)
                if after is None:
                    self._buf = self._buf[len(before) :]
                    return out
                self._buf, self._opener, self._state = after, START, _OPEN
            elif self._state == _OPEN:
                body = self._buf.lstrip()
                self._opener += self._buf[: len(self._buf) - len(body)]
                self._buf = body
                if not body:
                    return out
                if body.startswith("["):
                    self._begin(self._opener)
                else:
                    out.append(self._opener)
                    self._state = _TEXT
            elif self._state == _LIST:
                if not self._head:
                    head = _HEAD.match(self._buf)
                    if head is None or head.end() == len(self._buf):
                        if _could_begin(self._buf):
                            return out
                        out.append(self._opener)  # not a call: content from here on
                        self._state = _TEXT
                        continue
                    if self._buf[head.end()] != "(":
                        out.append(self._opener)
                        self._state = _TEXT
                        continue
                    self._head = True
                end = self._scan.end(self._buf)
                if end < 0:
                    return out
                body, self._buf = self._buf[:end], self._buf[end:]
                calls = parse_calls(body, self.names)
                if calls is None:
                    out.append(self._opener + body)
                    self._state = _TEXT
                else:
                    out.extend(calls)
                    self._state = _AFTER
            else:  # _AFTER
                body = self._buf.lstrip()
                if not body or is_partial(body, END):
                    return out
                if body.startswith(END):
                    self._buf = body[len(END) :]
                self._state = _TEXT

    def _rest(self) -> str:
        rest = self._buf
        if self._state in (_OPEN, _LIST):
            rest = self._opener + rest
        elif self._state == _AFTER and is_partial(rest.lstrip(), END):
            rest = ""  # the end tag, cut short
        self._buf, self._state = "", _TEXT
        return rest

    def _begin(self, opener: str) -> None:
        self._opener, self._scan, self._head = opener, Brackets("\"'"), False
        self._state = _LIST


def _could_begin(text: str) -> bool:
    """Whether `text` (from the `[`) may still grow into `[name(`."""
    rest = text[1:].lstrip()
    if not rest:
        return True
    name = re.match(r"[A-Za-z_][\w.]*", rest)
    return name is not None and not rest[name.end() :].strip()


def parse_calls(text: str, names: Collection[str]) -> list[ToolCall] | None:
    """The calls of a Python list of calls, or None unless all of it is calls of known tools
    with literal keyword arguments."""
    try:
        tree = ast.parse(text.strip(), mode="eval")
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        return None
    if not isinstance(tree.body, ast.List) or not tree.body.elts:
        return None
    calls: list[ToolCall] = []
    for node in tree.body.elts:
        if not isinstance(node, ast.Call) or node.args:
            return None
        name = _dotted(node.func)
        try:
            args = {_keyword(k): _literal(k.value) for k in node.keywords}
        except ValueError:
            return None
        call = make_call(name, args, names)
        if call is None:
            return None
        calls.append(call)
    return calls


def _dotted(node: ast.expr) -> str | None:
    """`f` or `module.f` as written, else None."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value)
        return None if base is None else f"{base}.{node.attr}"
    return None


def _keyword(k: ast.keyword) -> str:
    if k.arg is None:  # **kwargs
        raise ValueError("not a literal argument")
    return k.arg


def _literal(node: ast.expr) -> Any:
    """The JSON value of a literal expression; ValueError for anything else."""
    if isinstance(node, ast.Constant):
        if node.value is None or isinstance(node.value, str | bool | int | float):
            return node.value
    elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
        value = _literal(node.operand)
        if isinstance(value, int | float) and not isinstance(value, bool):
            return -value if isinstance(node.op, ast.USub) else value
    elif isinstance(node, ast.List | ast.Tuple):
        return [_literal(e) for e in node.elts]
    elif isinstance(node, ast.Dict):
        out: dict[str, Any] = {}
        for key, value in zip(node.keys, node.values, strict=True):
            if not isinstance(key, ast.Constant) or not isinstance(key.value, str):
                raise ValueError("a dict key that is not a string")
            out[key.value] = _literal(value)
        return out
    elif isinstance(node, ast.Name) and node.id in _JSON_NAMES:
        return _JSON_NAMES[node.id]
    raise ValueError("not a literal")

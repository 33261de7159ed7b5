"""Mistral tool calls (vLLM's `mistral`): text, then the `[TOOL_CALLS]` token and the calls.

Two forms occur. Older templates (Mistral 7B v0.3, Ministral, Nemo) write one JSON array of
`{"name": ..., "arguments": {...}}` objects: `[TOOL_CALLS] [{...}, {...}]`. Newer ones
(tokenizer v11 on: Mistral Small 3.x, Magistral, Devstral) write each call as
`[TOOL_CALLS]name[ARGS]{...}`, some with `[CALL_ID]id` before `[ARGS]`; decoded without special
tokens `[ARGS]` may be missing (`[TOOL_CALLS]name{...}`). An array is all calls or, if any
element is not a call of a known tool, all content (its elements have no text of their own
to keep), so its calls arrive when it closes.

`[TOOL_CALLS]` is a special token: decoded with special tokens skipped it is gone, and the
output is the bare array. So an output that begins (after whitespace) with `[` and then `{`
is read as the array too.
"""

from __future__ import annotations

import json
import re
from collections.abc import Collection

from cluster.ingress.tool_formats.base import (
    Brackets,
    Event,
    ToolCall,
    ToolCallReader,
    call_from_obj,
    is_partial,
    make_call,
    split_at_marker,
)

MARK = "[TOOL_CALLS]"
ARGS = "[ARGS]"
CALL_ID = "[CALL_ID]"
_NAME = re.compile(r"[A-Za-z0-9_.\-]+")
_ID = re.compile(r"[A-Za-z0-9]+")


class MistralParser(ToolCallReader):
    """Reads `[TOOL_CALLS]` regions; see the module doc."""

    def __init__(
        self, names: Collection[str], constrained: bool, max_calls: int | None = None
    ) -> None:
        super().__init__(names, constrained, max_calls)
        self._buf = ""  # while inside, starts with MARK: the region is kept whole until judged
        self._inside = False
        self._fresh = True  # nothing but whitespace so far: a bare array may begin here
        self._mark = len(MARK)  # length of the marker the region starts with (0: bare array)
        self._scan: Brackets | None = None  # of the JSON value the region ends with
        self._scan_at = 0  # where that value starts in the buffer

    def _read(self, text: str) -> list[Event]:
        self._buf += text
        out: list[Event] = []
        while True:
            if self._fresh:
                body = self._buf.lstrip()
                array = body[1:].lstrip()
                if not body or (body[0] == "[" and not array):
                    return out  # whitespace, or `[` not yet followed by anything
                self._fresh = False
                if body[0] == "[" and array[0] == "{":
                    self._buf, self._mark = body, 0
                    self._inside, self._scan = True, None
                    continue
            if not self._inside:
                before, after = split_at_marker(self._buf, MARK)
                out.append(before)
                if after is None:
                    self._buf = self._buf[len(before) :]
                    return out
                self._buf, self._mark = self._buf[len(before) :], len(MARK)
                self._inside, self._scan = True, None
                continue
            judged = self._region()
            if judged is None:
                return out
            end, calls = judged
            region, self._buf = self._buf[:end], self._buf[end:]
            self._inside = False
            out.extend(calls if calls else [region])

    def _rest(self) -> str:
        rest, self._buf, self._inside, self._fresh = self._buf, "", False, False
        return rest

    def _region(self) -> tuple[int, list[ToolCall] | None] | None:
        """None while the region is unfinished, else (its length, its calls — None when it is
        content)."""
        buf = self._buf
        at = _skip_space(buf, self._mark)
        if at == len(buf):
            return None
        if buf[at] in "[{":  # the JSON array, or a lone call object
            end = self._value_end(at)
            if end < 0:
                return None
            if buf[at] == "[":
                return end, _array_calls(buf[at:end], self.names)
            call = _object_call(buf[at:end], self.names)
            return end, [call] if call else None
        name = _NAME.match(buf, at)
        if name is None:
            return at, None  # the token, then text
        at = name.end()
        if at == len(buf) or is_partial(buf[at:], CALL_ID) or is_partial(buf[at:], ARGS):
            return None  # the name, or a marker after it, may go on
        if buf.startswith(CALL_ID, at):
            at += len(CALL_ID)
            call_id = _ID.match(buf, at)
            if call_id is None:
                return None if at == len(buf) else (at, None)
            at = call_id.end()
            if at == len(buf) or is_partial(buf[at:], ARGS):
                return None
        if buf.startswith(ARGS, at):
            at += len(ARGS)
        at = _skip_space(buf, at)
        if at == len(buf):
            return None
        if buf[at] != "{":
            return at, None
        end = self._value_end(at)
        if end < 0:
            return None
        try:
            args = json.loads(buf[at:end])
        except json.JSONDecodeError:
            return end, None
        call = make_call(name.group(), args, self.names)
        return end, [call] if call else None

    def _value_end(self, at: int) -> int:
        """Where the bracketed value starting at `at` ends (-1: not yet)."""
        if self._scan is None or self._scan_at != at:
            self._scan, self._scan_at = Brackets(), at
        end = self._scan.end(self._buf[at:])
        return end if end < 0 else at + end


def _skip_space(text: str, at: int) -> int:
    while at < len(text) and text[at].isspace():
        at += 1
    return at


def _object_call(text: str, names: Collection[str]) -> ToolCall | None:
    try:
        return call_from_obj(json.loads(text), names)
    except json.JSONDecodeError:
        return None


def _array_calls(text: str, names: Collection[str]) -> list[ToolCall] | None:
    """All the array's calls, or None unless every element is a call of a known tool."""
    try:
        items = json.loads(text)
    except json.JSONDecodeError:
        return None
    if not isinstance(items, list) or not items:
        return None
    calls = [call_from_obj(item, names) for item in items]
    return None if any(c is None for c in calls) else calls  # type: ignore[return-value]

"""Tool calls read from the model's output, whole or as it streams, for both ingresses.

Two formats (see cluster/ingress/tools.py): with tool_choice "auto" the model writes
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks between ordinary text (the
chat template's convention); with "required" or a named function its output is constrained
to a JSON array of those objects. `ToolCallParser` reads either incrementally: `feed` takes
each new piece of text and returns what became certain — content text and whole calls — and
`finish` flushes the rest. A non-streamed answer is one `feed` of the whole text, so both
paths give the same calls. A block that is not a valid call stays in the content, never lost.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

OPEN = "<tool_call>"
CLOSE = "</tool_call>"


@dataclass(frozen=True)
class ToolCall:
    """One parsed call; `arguments` is the JSON text of the arguments object."""

    name: str
    arguments: str
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def as_openai(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


Event = str | ToolCall  # content text, or a whole call


def call_from_json(text: str, names: Collection[str]) -> ToolCall | None:
    """A call from its JSON object text, or None if it is not a call of a known tool."""
    try:
        obj = json.loads(text)
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or obj.get("name") not in names:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


class ToolCallParser:
    """Incremental reader of one choice's output. `constrained`: the output is the JSON array
    of calls; otherwise `<tool_call>` blocks in text."""

    def __init__(
        self, names: Collection[str], constrained: bool, max_calls: int | None = None
    ) -> None:
        self.names = frozenset(names)
        self.constrained = constrained
        self.max_calls = max_calls  # 1 when parallel_tool_calls is false: later calls dropped
        self.calls = 0  # calls returned so far
        self._buf = ""
        self._inside = False  # auto: within a <tool_call> block
        self._ws = ""  # whitespace held back until content follows it
        self._started = False  # some content has been returned
        # constrained: JSON scanner state over the whole output
        self._text = ""
        self._depth = 0
        self._in_string = False
        self._escape = False
        self._element = -1  # where the array element being read starts

    def feed(self, text: str) -> list[Event]:
        if not text:
            return []
        if self.constrained:
            return self._feed_json(text)
        return self._content(self._feed_tags(text))

    def finish(self) -> list[Event]:
        """What is left at the end of the output (an unclosed block is content)."""
        if self.constrained:
            # No complete call (e.g. cut off by max_tokens): the text is all there is.
            rest = self._text if self.calls == 0 else ""
            self._text = ""
            return [rest] if rest.strip() else []
        rest = (OPEN + self._buf) if self._inside else self._buf
        self._buf, self._inside = "", False
        events = self._content([rest])
        self._ws = ""  # trailing whitespace is dropped
        return events

    # -- auto: <tool_call> blocks ------------------------------------------------------------

    def _feed_tags(self, text: str) -> list[Event]:
        self._buf += text
        out: list[Event] = []
        while True:
            if not self._inside:
                i = self._buf.find(OPEN)
                if i < 0:
                    keep = _partial_suffix(self._buf, OPEN)
                    out.append(self._buf[: len(self._buf) - keep])
                    self._buf = self._buf[len(self._buf) - keep :]
                    return out
                out.append(self._buf[:i])
                self._buf = self._buf[i + len(OPEN) :]
                self._inside = True
            else:
                j = self._buf.find(CLOSE)
                if j < 0:
                    return out
                body = self._buf[:j]
                self._buf = self._buf[j + len(CLOSE) :]
                self._inside = False
                call = call_from_json(body.strip(), self.names)
                out.append(call if call is not None else OPEN + body + CLOSE)

    def _content(self, events: list[Event]) -> list[Event]:
        """Content in order, but whitespace next to calls and at either end is dropped."""
        out: list[Event] = []
        for e in events:
            if isinstance(e, ToolCall):
                self._ws = ""  # whitespace just before a call only separates
                if self.max_calls is None or self.calls < self.max_calls:
                    self.calls += 1
                    out.append(e)
                continue
            if not self._started:
                e = e.lstrip()
            # Trailing whitespace waits: it is content only if more content follows it.
            body = e.rstrip()
            if body:
                out.append(self._ws + body)
                self._started = True
                self._ws = e[len(body) :]
            elif self._started:
                self._ws += e
        return out

    # -- constrained: a JSON array of call objects ---------------------------------------------

    def _feed_json(self, text: str) -> list[Event]:
        out: list[Event] = []
        base = len(self._text)
        self._text += text
        for k, ch in enumerate(text):
            pos = base + k
            if self._in_string:
                if self._escape:
                    self._escape = False
                elif ch == "\\":
                    self._escape = True
                elif ch == '"':
                    self._in_string = False
                continue
            if ch == '"':
                self._in_string = True
            elif ch in "[{":
                if self._depth == 1 and ch == "{":
                    self._element = pos
                self._depth += 1
            elif ch in "]}":
                self._depth -= 1
                if self._depth == 1 and ch == "}" and self._element >= 0:
                    call = call_from_json(self._text[self._element : pos + 1], self.names)
                    self._element = -1
                    if call is not None:
                        self.calls += 1
                        out.append(call)
        return out


def parse_all(
    text: str, names: Collection[str], constrained: bool, max_calls: int | None = None
) -> tuple[str | None, list[ToolCall]]:
    """(content or None, calls) of a whole output."""
    parser = ToolCallParser(names, constrained, max_calls)
    events = parser.feed(text) + parser.finish()
    calls = [e for e in events if isinstance(e, ToolCall)]
    content = "".join(e for e in events if isinstance(e, str))
    return (content or None), calls


def finish_reason(reason: str | None, calls: int) -> str | None:
    """OpenAI's "tool_calls" for a choice that ended normally with calls."""
    return "tool_calls" if reason == "stop" and calls else reason


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of `text` that could be the start of `marker`."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0

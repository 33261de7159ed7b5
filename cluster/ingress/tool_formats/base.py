"""What every tool-call format shares: the call, the events a reader returns, and the reader.

A reader takes one choice's output piece by piece (`feed`) and returns what became certain:
content text and whole calls; `finish` flushes the rest. Each format only says how calls look
in free text (`_read` / `_rest`); the rest is common, so every format treats content the same
way (whitespace next to calls dropped, text that is not a valid call of a known tool kept as
content, never lost) and reads `constrained` output — the JSON array of call objects that
tool_choice "required" or a named function produces through a grammar — the same way.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any


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


def make_call(name: Any, args: Any, names: Collection[str]) -> ToolCall | None:
    """A call of a known tool with an arguments object, or None."""
    if not isinstance(name, str) or name not in names:
        return None
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    if not isinstance(args, dict):
        return None
    try:  # NaN / Infinity are not JSON: a client could not read them back
        text = json.dumps(args, ensure_ascii=False, allow_nan=False)
    except ValueError:
        return None
    return ToolCall(name, text)


def call_from_obj(obj: Any, names: Collection[str]) -> ToolCall | None:
    """A call from a decoded `{"name": ..., "arguments"|"parameters": {...}}` object."""
    if not isinstance(obj, dict):
        return None
    return make_call(obj.get("name"), obj.get("arguments", obj.get("parameters", {})), names)


def call_from_json(text: str, names: Collection[str]) -> ToolCall | None:
    """A call from its JSON object text, or None if it is not a call of a known tool."""
    try:
        obj = json.loads(text)
    except json.JSONDecodeError:
        return None
    return call_from_obj(obj, names)


def partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of `text` that could be the start of `marker`."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def split_at_marker(buf: str, marker: str) -> tuple[str, str | None]:
    """(text before `marker`, text after it) — or, without it, (what is certainly not part of
    it, None), leaving any partial marker at the end unreturned for the caller to hold."""
    i = buf.find(marker)
    if i >= 0:
        return buf[:i], buf[i + len(marker) :]
    return buf[: len(buf) - partial_suffix(buf, marker)], None


def split_at_first(buf: str, markers: tuple[str, ...]) -> tuple[str, str | None, str]:
    """`split_at_marker` for the first of several markers: (before, the marker, after) — or,
    with none of them whole in `buf`, (what is certainly text, None, "")."""
    found = [(i, m) for m in markers if (i := buf.find(m)) >= 0]
    if found:
        i, marker = min(found)
        return buf[:i], marker, buf[i + len(marker) :]
    keep = max(partial_suffix(buf, m) for m in markers)
    return buf[: len(buf) - keep], None, ""


def is_partial(text: str, marker: str) -> bool:
    """Whether `text` is a proper start of `marker` (more output may complete it)."""
    return len(text) < len(marker) and marker.startswith(text)


class Brackets:
    """Finds where a bracketed value ends: the text passed always starts with its opening
    bracket, and grows between calls (the scan resumes where it stopped, so streaming stays
    linear). Brackets inside string literals (`quotes`) do not count."""

    def __init__(self, quotes: str = '"') -> None:
        self.quotes = quotes
        self.depth = 0
        self.quote = ""  # the quote of the string being read, "" outside strings
        self.escape = False
        self.pos = 0

    def end(self, text: str) -> int:
        """Index just past the bracket closing text[0]'s, or -1 while it is still open."""
        for i in range(self.pos, len(text)):
            ch = text[i]
            if self.quote:
                if self.escape:
                    self.escape = False
                elif ch == "\\":
                    self.escape = True
                elif ch == self.quote:
                    self.quote = ""
            elif ch in self.quotes:
                self.quote = ch
            elif ch in "[{(":
                self.depth += 1
            elif ch in "]})":
                self.depth -= 1
                if self.depth == 0:
                    self.pos = i + 1
                    return i + 1
        self.pos = len(text)
        return -1


class ToolCallReader:
    """Incremental reader of one choice's output. `constrained`: the output is the JSON array
    of calls; otherwise calls in the format's own form between content text (`_read`)."""

    def __init__(
        self, names: Collection[str], constrained: bool, max_calls: int | None = None
    ) -> None:
        self.names = frozenset(names)
        self.constrained = constrained
        self.max_calls = max_calls  # 1 when parallel_tool_calls is false: later calls dropped
        self.calls = 0  # calls returned so far
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
        return self._content(self._read(text))

    def finish(self) -> list[Event]:
        """What is left at the end of the output (an unfinished call is content)."""
        if self.constrained:
            # No complete call (e.g. cut off by max_tokens): the text is all there is.
            rest = self._text if self.calls == 0 else ""
            self._text = ""
            return [rest] if rest.strip() else []
        events = self._content([self._rest()])
        self._ws = ""  # trailing whitespace is dropped
        return events

    # -- what a format says --------------------------------------------------------------------

    def _read(self, text: str) -> list[Event]:
        """Content and calls that `text` (the next piece of output) made certain."""
        raise NotImplementedError

    def _rest(self) -> str:
        """At the end of the output: the text still held back (all of it is content)."""
        raise NotImplementedError

    # -- shared --------------------------------------------------------------------------------

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

    def _feed_json(self, text: str) -> list[Event]:
        """Constrained output: each array element is a call once it closes."""
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

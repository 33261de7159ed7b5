"""Llama 3.1 / 3.2 / 4 JSON tool calls (vLLM's `llama3_json`, also its `llama4_json`).

The model answers with the call itself instead of text: one JSON object
`{"name": ..., "parameters": {...}}` ("arguments" is accepted too), several separated by `;`,
optionally after the `<|python_tag|>` token (Llama 4's template writes its calls right after
`<|python_end|>`, which closes the turn's text). So calls are read where the output begins
with `{` (after whitespace), and after either token anywhere. A `{` later in the text is prose
(an answer that quotes JSON), and an object that is not a call of a known tool is content, as
is everything after it.
"""

from __future__ import annotations

from collections.abc import Collection

from cluster.ingress.tool_formats.base import (
    Brackets,
    Event,
    ToolCallReader,
    call_from_json,
    is_partial,
    split_at_first,
)

TAG = "<|python_tag|>"
END = "<|python_end|>"  # Llama 4: the end of the text before the calls
_OPENERS = (TAG, END)

# Where the reader is in the output.
_START = "start"  # only whitespace so far: a `{` here opens the list of calls
_TEXT = "text"  # content; only the tag opens a list of calls
_LIST = "list"  # in a list of calls, between objects
_OBJECT = "object"  # inside an object of the list


class Llama3JsonParser(ToolCallReader):
    """Reads lists of JSON call objects; see the module doc."""

    def __init__(
        self, names: Collection[str], constrained: bool, max_calls: int | None = None
    ) -> None:
        super().__init__(names, constrained, max_calls)
        self._buf = ""
        self._state = _START
        self._opener = ""  # what opened the list: a token, or "" at the output's start
        self._sep = ""  # whitespace and `;` read since the last object
        self._listed = 0  # calls read in this list
        self._scan = Brackets()

    def _read(self, text: str) -> list[Event]:
        self._buf += text
        out: list[Event] = []
        while True:
            if self._state == _START:
                body = self._buf.lstrip()
                if not body or any(is_partial(body, m) for m in _OPENERS):
                    return out  # leading whitespace is never content; a tag may be forming
                if body.startswith("{"):
                    self._buf = body
                    self._open("")
                    self._begin_object()
                else:
                    self._state = _TEXT
            elif self._state == _TEXT:
                before, opener, after = split_at_first(self._buf, _OPENERS)
                out.append(before)
                if opener is None:
                    self._buf = self._buf[len(before) :]
                    return out
                self._buf = after
                self._open(opener)
            elif self._state == _LIST:
                rest = self._buf.lstrip().lstrip(";")
                while rest != self._buf:  # separators: whitespace and `;`, any mix
                    self._sep += self._buf[: len(self._buf) - len(rest)]
                    self._buf = rest
                    rest = self._buf.lstrip().lstrip(";")
                if not self._buf:
                    return out
                if self._buf.startswith("{"):
                    self._begin_object()
                else:  # the list is over; a tag alone (nothing listed) was content
                    out.append(self._unlisted())
                    self._state = _TEXT
            else:  # _OBJECT
                end = self._scan.end(self._buf)
                if end < 0:
                    return out
                body, self._buf = self._buf[:end], self._buf[end:]
                call = call_from_json(body, self.names)
                if call is None:
                    out.append(self._unlisted() + body)
                    self._state = _TEXT
                else:
                    out.append(call)
                    self._listed += 1
                    self._sep = ""
                    self._state = _LIST

    def _rest(self) -> str:
        if self._state in (_LIST, _OBJECT):
            rest = self._unlisted() + self._buf
        else:
            rest = self._buf
        self._buf, self._state = "", _TEXT
        return rest

    def _open(self, opener: str) -> None:
        self._opener, self._sep, self._listed = opener, "", 0
        self._state = _LIST

    def _begin_object(self) -> None:
        self._scan = Brackets()
        self._state = _OBJECT

    def _unlisted(self) -> str:
        """What opened the list and the separators after it, when they turn out to be content:
        before any call (after one, they were the list's punctuation)."""
        return self._opener + self._sep if self._listed == 0 else ""

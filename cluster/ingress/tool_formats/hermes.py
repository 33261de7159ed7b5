"""Hermes / Qwen tool calls: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks
between ordinary text — the convention of Hermes, Qwen 2.5 / Qwen 3 and many fine-tunes, and
kvray's default. vLLM calls this format `hermes`.
"""

from __future__ import annotations

from collections.abc import Collection

from cluster.ingress.tool_formats.base import (
    Event,
    ToolCall,
    ToolCallReader,
    call_from_json,
    split_at_marker,
)

OPEN = "<tool_call>"
CLOSE = "</tool_call>"


class ToolCallParser(ToolCallReader):
    """Reads `<tool_call>` blocks; a block whose body is not a call stays in the content with
    its tags. Subclasses with other bodies in the same tags override `_call`."""

    def __init__(
        self, names: Collection[str], constrained: bool, max_calls: int | None = None
    ) -> None:
        super().__init__(names, constrained, max_calls)
        self._buf = ""
        self._inside = False  # within a <tool_call> block

    def _call(self, body: str) -> ToolCall | None:
        """The call a block's body holds, or None."""
        return call_from_json(body.strip(), self.names)

    def _read(self, text: str) -> list[Event]:
        self._buf += text
        out: list[Event] = []
        while True:
            if not self._inside:
                before, after = split_at_marker(self._buf, OPEN)
                out.append(before)
                if after is None:
                    self._buf = self._buf[len(before) :]
                    return out
                self._buf, self._inside = after, True
            else:
                body, after = split_at_marker(self._buf, CLOSE)
                if after is None:
                    return out
                self._buf, self._inside = after, False
                call = self._call(body)
                out.append(call if call is not None else OPEN + body + CLOSE)

    def _rest(self) -> str:
        rest = (OPEN + self._buf) if self._inside else self._buf
        self._buf, self._inside = "", False
        return rest

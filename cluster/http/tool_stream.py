"""Chat deltas of a streamed choice whose output is read for tool calls or reasoning.

The official `openai` client (and its `chat.completions.stream` helper) assembles a call from
deltas keyed by `index`: the first carries `id`, `type` and `function.name` (arguments ""),
later ones append to `function.arguments`. Each call is sent that way once it is whole
(cluster/ingress/tool_calls.py decides when), in two deltas; content text between calls is
sent as ordinary `content` deltas. With a reasoning parser on, the thinking comes first, as
`reasoning_content` deltas (vLLM's field), and calls are read from the answer after it only
(cluster/ingress/reasoning.py).
"""

from __future__ import annotations

from typing import Any

from cluster.ingress.output_parsing import Reasoning
from cluster.ingress.reasoning import AnswerReader, Thought
from cluster.ingress.tool_calls import ToolCall, ToolCallReader, finish_reason


class ToolStream:
    """The deltas of one choice; `calls` counts the calls sent (the next call's index).
    `parser`: the choice's tool-call reader (None: no tools); `reasoning`: the request's
    reasoning (None: the parser is off)."""

    def __init__(self, parser: ToolCallReader | None, reasoning: Reasoning | None = None) -> None:
        self.reader = AnswerReader(reasoning, parser)
        self.calls = 0

    def deltas(self, text: str, finished: bool) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for e in self.reader.feed(text, finished):
            if isinstance(e, ToolCall):
                out.extend(self._call(e))
            elif isinstance(e, Thought):
                if out and "reasoning_content" in out[-1]:
                    out[-1]["reasoning_content"] += e.text
                else:
                    out.append({"reasoning_content": e.text})
            elif out and "content" in out[-1]:
                out[-1]["content"] += e
            else:
                out.append({"content": e})
        return out

    def _call(self, call: ToolCall) -> list[dict[str, Any]]:
        index = self.calls
        self.calls += 1
        head = {
            "index": index,
            "id": call.id,
            "type": "function",
            "function": {"name": call.name, "arguments": ""},
        }
        args = {"index": index, "function": {"arguments": call.arguments}}
        return [{"tool_calls": [head]}, {"tool_calls": [args]}]

    def finish_reason(self, reason: str | None) -> str | None:
        return finish_reason(reason, self.calls)

"""How one ingress replica reads its model's answers: the tool-call format and the reasoning
parser of the deployment (cluster/config/parsing.py), resolved against the served model's
tokenizer once, when the ingress starts.

Where a request's output starts matters for reasoning: DeepSeek-R1's template (and newer
Qwen3 templates) open the `<think>` block in the prompt, so the output starts inside the
reasoning; a template with thinking switched off (Qwen3's `enable_thinking: false`) closes
an empty block in the prompt, so the output is all answer. `OutputParsing.reasoning_for`
reads that from the prompt's token ids: the last marker the prompt holds decides.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from cluster.config.parsing import ParsingSettings

THINK_START = "<think>"
THINK_END = "</think>"
# How far back from the prompt's end a marker is looked for: templates write the generation
# prompt's markers in its last few tokens, and a long prompt is not scanned per request.
MARKER_WINDOW = 256


@dataclass(frozen=True)
class Reasoning:
    """One request's reasoning: the parser; whether its output starts inside the reasoning
    (the prompt opened a `<think>` block and did not close it); whether, starting in the
    answer, the model may still open one (the prompt did not close one: Qwen3 writes its own
    `<think>`). Neither: the prompt closed the reasoning (thinking switched off)."""

    parser: str
    inside: bool
    may_open: bool = False


@dataclass(frozen=True)
class OutputParsing:
    """The deployment's output parsing, resolved: `tool_format` is a concrete format (never
    "auto"); `start_ids` / `end_ids` are the reasoning markers as the tokenizer encodes them."""

    tool_format: str = "hermes"
    reasoning: str | None = None
    start_ids: tuple[int, ...] = ()
    end_ids: tuple[int, ...] = ()

    @classmethod
    def resolve(
        cls,
        settings: ParsingSettings,
        chat_template: str | None,
        encode: Callable[[str], Sequence[int]],
    ) -> OutputParsing:
        """`chat_template`: the served model's template text (None without one), for "auto";
        `encode(text)`: token ids without special tokens added."""
        from cluster.ingress.tool_formats import detect_tool_format

        fmt = settings.tool_call_parser
        if fmt == "auto":
            fmt = detect_tool_format(chat_template)
        if settings.reasoning_parser is None:
            return cls(tool_format=fmt)
        return cls(
            tool_format=fmt,
            reasoning=settings.reasoning_parser,
            start_ids=tuple(encode(THINK_START)),
            end_ids=tuple(encode(THINK_END)),
        )

    @classmethod
    def of(cls, settings: ParsingSettings, tokenizer: Any) -> OutputParsing:
        """Resolved against a workers.tokenizer.Tokenizer (its template and vocabulary)."""
        template = getattr(tokenizer.hf, "chat_template", None)
        return cls.resolve(
            settings,
            template if isinstance(template, str) else None,
            lambda text: tokenizer.encode(text, add_special_tokens=False),
        )

    def reasoning_for(self, prompt_ids: Sequence[int]) -> Reasoning | None:
        """The request's Reasoning (None with the parser off). A prompt whose last marker is
        an open `<think>` starts the output inside the reasoning, one whose last marker closes
        it starts in the answer; with neither, DeepSeek-R1's output starts inside (its models
        may leave the opening tag out) and Qwen3's in the answer (it writes the tag itself)."""
        if self.reasoning is None:
            return None
        opened = _last(prompt_ids, self.start_ids)
        closed = _last(prompt_ids, self.end_ids)
        if opened < 0 and closed < 0:
            r1 = self.reasoning == "deepseek_r1"
            return Reasoning(self.reasoning, inside=r1, may_open=not r1)
        return Reasoning(self.reasoning, inside=opened > closed)


def _last(ids: Sequence[int], marker: Sequence[int]) -> int:
    """Where the last occurrence of `marker` in the last MARKER_WINDOW tokens of `ids`
    starts; -1 when there is none."""
    n = len(marker)
    if not n:
        return -1
    first = marker[0]
    for i in range(len(ids) - n, max(len(ids) - MARKER_WINDOW, 0) - 1, -1):
        if ids[i] == first and list(ids[i : i + n]) == list(marker):
            return i
    return -1

"""A reasoning model's output split into its thinking and its answer (vLLM's reasoning parsers).

Where the output starts is the request's `Reasoning` (cluster/ingress/output_parsing.py):

- `inside`: the output starts inside the reasoning (the prompt opened `<think>`, or
  DeepSeek-R1, whose models may leave the opening tag out): text up to `</think>` is
  reasoning, the rest answer. A `<think>` the model writes at the very start anyway is a tag,
  not reasoning.
- `may_open`: the output starts in the answer, but the model may open a `<think>` block at its
  very start (after whitespace), as Qwen3 does: then text up to `</think>` is reasoning, the
  rest answer; otherwise all of it is answer.
- neither: the prompt closed the reasoning (thinking switched off): all of it is answer.

An output that ends inside the reasoning (no `</think>`: cut off by max_tokens, or the model
stopped) keeps what it had as reasoning, and has no answer. The markers are never shown;
whitespace around the reasoning and at the answer's start (the usual "\n\n" after
`</think>`) is dropped. `ReasoningSplitter` reads the output as it streams, holding back what
may be the start of a marker (or whitespace that may turn out to end the reasoning), so that
a streamed output splits exactly as the whole one does.

`AnswerReader` puts the splitter in front of a request's tool-call parser: calls are read from
the answer only, never from the reasoning.
"""

from __future__ import annotations

from dataclasses import dataclass

from cluster.ingress.output_parsing import THINK_END, THINK_START, Reasoning
from cluster.ingress.tool_calls import ToolCall, ToolCallReader

REASONING = "reasoning"
CONTENT = "content"
_HEAD = "head"  # the output's start, where an opening tag may still come


class ReasoningSplitter:
    """Incremental splitter of one output: `feed` each new piece of text, `finish` at the end;
    each returns (kind, text) pairs, kind REASONING or CONTENT, in the output's order."""

    def __init__(self, reasoning: Reasoning) -> None:
        self._inside = reasoning.inside
        opens = reasoning.inside or reasoning.may_open
        self._state = _HEAD if opens else CONTENT
        self._buf = ""  # text not yet returned
        self._trim = False  # whitespace at the current part's start is dropped

    def feed(self, text: str) -> list[tuple[str, str]]:
        self._buf += text
        return self._run(final=False)

    def finish(self) -> list[tuple[str, str]]:
        """What is held back, at the end of the output."""
        return self._run(final=True)

    def _run(self, final: bool) -> list[tuple[str, str]]:
        out: list[tuple[str, str]] = []
        while self._buf:
            if self._state == _HEAD:
                body = self._buf.lstrip()
                if body.startswith(THINK_START):
                    self._buf = body[len(THINK_START) :]
                    self._state, self._trim = REASONING, True
                    continue
                if not final and THINK_START.startswith(body):  # whitespace, or part of a tag
                    break
                # No tag: inside, it is reasoning already; may_open, all of it is answer
                # (as written, leading whitespace included).
                self._state = REASONING if self._inside else CONTENT
                self._trim = self._inside
                continue
            if self._trim:
                self._buf = self._buf.lstrip()
                if not self._buf:
                    break
                self._trim = False
            if self._state == CONTENT:
                out.append((CONTENT, self._buf))
                self._buf = ""
                break
            end = self._buf.find(THINK_END)
            if end >= 0:
                out.append((REASONING, self._buf[:end].rstrip()))
                self._buf = self._buf[end + len(THINK_END) :]
                self._state, self._trim = CONTENT, True
                continue
            if final:
                out.append((REASONING, self._buf.rstrip()))
                self._buf = ""
                break
            keep = _held(self._buf)
            out.append((REASONING, self._buf[: len(self._buf) - keep]))
            self._buf = self._buf[len(self._buf) - keep :]
            break
        return _merged(out)


def _held(text: str) -> int:
    """How many characters at the end of reasoning `text` to hold back: a partial `</think>`
    and the whitespace before it (dropped if the reasoning ends there)."""
    partial = 0
    for n in range(min(len(text), len(THINK_END) - 1), 0, -1):
        if THINK_END.startswith(text[-n:]):
            partial = n
            break
    head = text[: len(text) - partial]
    return len(text) - len(head.rstrip())


def _merged(pairs: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """Pairs without empty texts, neighbours of one kind joined."""
    out: list[tuple[str, str]] = []
    for kind, text in pairs:
        if not text:
            continue
        if out and out[-1][0] == kind:
            out[-1] = (kind, out[-1][1] + text)
        else:
            out.append((kind, text))
    return out


def split_reasoning(reasoning: Reasoning, text: str) -> tuple[str | None, str | None]:
    """A whole output's (reasoning, answer); None for a part that is empty."""
    splitter = ReasoningSplitter(reasoning)
    pairs = splitter.feed(text) + splitter.finish()
    thought = "".join(t for kind, t in pairs if kind == REASONING)
    answer = "".join(t for kind, t in pairs if kind == CONTENT)
    return thought or None, answer or None


@dataclass(frozen=True)
class Thought:
    """A piece of the reasoning, as AnswerReader returns it."""

    text: str


Piece = str | ToolCall | Thought  # answer text, a whole tool call, or reasoning text


class AnswerReader:
    """One output read as it arrives: its reasoning (`reasoning`: the request's, None with the
    parser off), then its answer, read for tool calls by `parser` (None: all text). A whole
    output is one `feed` with `finished`, so both paths give the same pieces."""

    def __init__(self, reasoning: Reasoning | None, parser: ToolCallReader | None) -> None:
        self.splitter = ReasoningSplitter(reasoning) if reasoning is not None else None
        self.parser = parser

    def feed(self, text: str, finished: bool = False) -> list[Piece]:
        if self.splitter is None:
            pairs = [(CONTENT, text)]
        else:
            pairs = self.splitter.feed(text) + (self.splitter.finish() if finished else [])
        out: list[Piece] = []
        for kind, part in pairs:
            if kind == REASONING:
                out.append(Thought(part))
            elif self.parser is not None:
                out.extend(self.parser.feed(part))
            elif part:
                out.append(part)
        if finished and self.parser is not None:
            out.extend(self.parser.finish())
        return out

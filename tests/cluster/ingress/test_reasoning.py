"""A reasoning model's output split into thinking and answer (cluster/ingress/reasoning.py):
where each parser's output starts, cut-off reasoning, and a streamed output split exactly as
the whole one, however it is cut into pieces."""

from __future__ import annotations

import json

import pytest

from cluster.ingress import tools
from cluster.ingress.output_parsing import Reasoning
from cluster.ingress.reasoning import (
    CONTENT,
    REASONING,
    AnswerReader,
    ReasoningSplitter,
    Thought,
    split_reasoning,
)
from cluster.ingress.tool_calls import ToolCall

QWEN3 = Reasoning("qwen3", inside=False, may_open=True)  # writes its own <think>
R1 = Reasoning("deepseek_r1", inside=True)  # the prompt opened <think> (or may have)
OFF = Reasoning("qwen3", inside=False)  # the prompt closed the reasoning: thinking off

CASES = [
    # Qwen3 thinks: the block is the reasoning, the answer starts after its whitespace.
    (QWEN3, "<think>\nLet me see.\n</think>\n\nHello!", "Let me see.", "Hello!"),
    (QWEN3, "\n<think>a</think>b", "a", "b"),
    # Qwen3 answers at once: all of it is the answer, as written.
    (QWEN3, "Hello!", None, "Hello!"),
    (QWEN3, "\n\nHello!", None, "\n\nHello!"),
    (QWEN3, "Hi <think>x</think> there", None, "Hi <think>x</think> there"),
    # An empty block (what Qwen3 writes with little to think about) is no reasoning.
    (QWEN3, "<think>\n\n</think>\n\nHi", None, "Hi"),
    # DeepSeek-R1 starts inside, with or without writing the opening tag.
    (R1, "Two and two.\n</think>\n\nFour.", "Two and two.", "Four."),
    (R1, "<think>\nTwo and two.\n</think>\n\nFour.", "Two and two.", "Four."),
    # Markers' look-alikes inside the reasoning stay reasoning.
    (R1, "a </b> <thin c</think>d", "a </b> <thin c", "d"),
    # Cut off (max_tokens) or stopped inside the reasoning: what it had is reasoning.
    (R1, "still thinking ", "still thinking", None),
    (R1, "still </thi", "still </thi", None),
    (QWEN3, "<think>\nhalf a tho", "half a tho", None),
    (QWEN3, "<thi", None, "<thi"),  # not a tag yet: the answer, as written
    (R1, "", None, None),
    # Thinking switched off in the prompt: everything is the answer.
    (OFF, "<think>x</think>y", None, "<think>x</think>y"),
    # Only the first </think> ends the reasoning.
    (R1, "a</think>b</think>c", "a", "b</think>c"),
]


@pytest.mark.parametrize(("reasoning", "text", "thought", "answer"), CASES)
def test_whole_outputs_split(
    reasoning: Reasoning, text: str, thought: str | None, answer: str | None
) -> None:
    assert split_reasoning(reasoning, text) == (thought, answer)


def _streamed(reasoning: Reasoning, text: str, size: int) -> list[tuple[str, str]]:
    splitter = ReasoningSplitter(reasoning)
    pairs = [p for i in range(0, len(text), size) for p in splitter.feed(text[i : i + size])]
    return pairs + splitter.finish()


@pytest.mark.parametrize(("reasoning", "text", "thought", "answer"), CASES)
@pytest.mark.parametrize("size", [1, 2, 3, 7])
def test_streamed_outputs_split_as_whole_ones(
    reasoning: Reasoning, text: str, thought: str | None, answer: str | None, size: int
) -> None:
    pairs = _streamed(reasoning, text, size)
    assert all(kind in (REASONING, CONTENT) and part for kind, part in pairs)
    kinds = [kind for kind, _ in pairs]
    assert kinds == sorted(kinds, key=lambda k: k == CONTENT)  # reasoning never after answer
    assert ("".join(p for k, p in pairs if k == REASONING) or None) == thought
    assert ("".join(p for k, p in pairs if k == CONTENT) or None) == answer


def test_a_partial_marker_is_held_back_while_streaming() -> None:
    splitter = ReasoningSplitter(R1)
    assert splitter.feed("abc </th") == [(REASONING, "abc")]
    assert splitter.feed("ink>\n") == []  # the whitespace after it may be all there is
    assert splitter.feed("\nAns") == [(CONTENT, "Ans")]
    assert splitter.feed("wer") == [(CONTENT, "wer")]
    assert splitter.finish() == []
    qwen = ReasoningSplitter(QWEN3)
    assert qwen.feed(" <th") == []  # maybe the opening tag
    assert qwen.feed("ink>x") == [(REASONING, "x")]


def test_one_feed_returns_both_parts_joined_by_kind() -> None:
    splitter = ReasoningSplitter(R1)
    assert splitter.feed("a b</think>\n\nc d") == [(REASONING, "a b"), (CONTENT, "c d")]


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
CALL = '<tool_call>{"name": "weather", "arguments": {"city": "Oslo"}}</tool_call>'


def _read(reasoning: Reasoning | None, text: str, size: int) -> list[object]:
    use = tools.tool_use(TOOLS, "auto", None)
    assert use is not None
    reader = AnswerReader(reasoning, use.parser())
    pieces = [text[i : i + size] for i in range(0, len(text), size)] or [""]
    return [e for i, p in enumerate(pieces) for e in reader.feed(p, i == len(pieces) - 1)]


@pytest.mark.parametrize("size", [1, 4, 1000])
def test_tool_calls_are_read_from_the_answer_only(size: int) -> None:
    # A call the model rehearses while thinking is reasoning, not a call.
    text = f"<think>I could call {CALL}.</think>\n\nSure.{CALL}"
    events = _read(QWEN3, text, size)
    thought = "".join(e.text for e in events if isinstance(e, Thought))
    assert thought == f"I could call {CALL}."
    assert "".join(e for e in events if isinstance(e, str)) == "Sure."
    calls = [e for e in events if isinstance(e, ToolCall)]
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("weather", {"city": "Oslo"})]


def test_without_a_reasoning_parser_the_reader_is_the_tool_parser() -> None:
    events = _read(None, f"<think>x</think>{CALL}", 1000)
    assert events[0] == "<think>x</think>" and isinstance(events[1], ToolCall)
    assert AnswerReader(None, None).feed("plain", finished=True) == ["plain"]

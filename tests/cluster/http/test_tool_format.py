"""Chat answers with tool calls (cluster/http/format.py + tool_stream.py), no server: the
non-streamed message, and SSE chunks that the official `openai` client's stream assembler
(`ChatCompletionStreamState`, what `client.chat.completions.stream` uses) turns into the
same calls."""

from __future__ import annotations

import json

import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState
from openai.types.chat import ChatCompletionChunk

from cluster.http.format import Formatter
from cluster.ingress import tools
from cluster.ingress.output_parsing import Reasoning
from cluster.ingress.token_text import TokenStrings
from workers.outputs import CompletionOutput, RequestOutput

TOKENS = TokenStrings(lambda ids: f"<{ids[0]}>")
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    },
    {"type": "function", "function": {"name": "time"}},
]
AUTO = 'Sure.<tool_call>{"name": "weather", "arguments": {"city": "Oslo"}}</tool_call>'
ARRAY = '[{"arguments":{"city":"Oslo"},"name":"weather"},{"arguments":{},"name":"time"}]'


def _fmt(choice: object, n: int = 1, reasoning: Reasoning | None = None) -> Formatter:
    use = tools.tool_use(TOOLS, choice, None)
    return Formatter("chat", "id-1", "kvray-demo", n, None, TOKENS, tools=use, reasoning=reasoning)


def _final(text: str, reason: str = "stop", index: int = 0) -> CompletionOutput:
    return CompletionOutput(index, text, list(range(len(text))), reason)


def _out(*cs: CompletionOutput, finished: bool = False) -> RequestOutput:
    return RequestOutput("id-1", None, [1, 2], list(cs), finished=finished)


def _calls(message: dict) -> list[tuple[str, dict]]:
    return [
        (c["function"]["name"], json.loads(c["function"]["arguments"]))
        for c in message.get("tool_calls") or []
    ]


@pytest.mark.parametrize(
    ("choice", "text", "content", "calls"),
    [
        ("auto", AUTO, "Sure.", [("weather", {"city": "Oslo"})]),
        ("auto", "no calls here", "no calls here", []),
        ("required", ARRAY, None, [("weather", {"city": "Oslo"}), ("time", {})]),
        ("none", AUTO, AUTO, []),
    ],
)
def test_whole_response_message(choice: str, text: str, content: str | None, calls: list) -> None:
    body = _fmt(choice).response([_out(_final(text), finished=True)])
    (ch,) = body["choices"]
    assert ch["message"]["content"] == content
    assert _calls(ch["message"]) == calls
    assert ch["finish_reason"] == ("tool_calls" if calls else "stop")
    for call in ch["message"].get("tool_calls", []):
        assert call["id"].startswith("call_") and call["type"] == "function"


def test_a_cut_off_call_keeps_finish_reason_length() -> None:
    body = _fmt("required").response([_out(_final('[{"argum', "length"), finished=True)])
    (ch,) = body["choices"]
    assert ch["finish_reason"] == "length" and "tool_calls" not in ch["message"]


def _stream(fmt: Formatter, texts: list[str], n: int = 1) -> list[dict]:
    frames: list[str] = []
    for i, piece in enumerate(texts):
        last = i == len(texts) - 1
        cs = [
            CompletionOutput(
                k, "", [], "stop" if last else None, delta_text=piece, delta_token_ids=[i]
            )
            for k in range(n)
        ]
        frames += fmt.chunks(_out(*cs, finished=last))
    return [json.loads(f[len("data: ") :]) for f in frames]


@pytest.mark.parametrize(("choice", "text"), [("auto", AUTO), ("required", ARRAY)])
@pytest.mark.parametrize("size", [1, 3, 7, 1000])
def test_streamed_calls_assemble_in_the_openai_client(choice: str, text: str, size: int) -> None:
    whole = _fmt(choice).response([_out(_final(text), finished=True)])["choices"][0]
    pieces = [text[i : i + size] for i in range(0, len(text), size)]
    state = ChatCompletionStreamState(input_tools=TOOLS)  # type: ignore[arg-type]
    chunks = _stream(_fmt(choice), pieces)
    for chunk in chunks:
        state.handle_chunk(ChatCompletionChunk.model_validate(chunk))
    (choice_out,) = state.get_final_completion().choices
    message = choice_out.message
    assert choice_out.finish_reason == "tool_calls"
    assert (message.content or None) == whole["message"]["content"]
    got = [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or []]
    assert got == _calls(whole["message"])
    # Each call: a head delta with id, type and name, then its arguments.
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert deltas[0]["role"] == "assistant"
    heads = [d["tool_calls"][0] for d in deltas if "tool_calls" in d and "id" in d["tool_calls"][0]]
    assert [h["index"] for h in heads] == list(range(len(got)))
    assert all(h["function"]["arguments"] == "" and h["type"] == "function" for h in heads)
    assert [c["choices"][0]["finish_reason"] for c in chunks].count("tool_calls") == 1


def test_streamed_choices_of_n2_keep_their_own_call_indexes() -> None:
    chunks = _stream(_fmt("required", n=2), [ARRAY[:10], ARRAY[10:]], n=2)
    for k in (0, 1):
        heads = [
            c["choices"][0]["delta"]["tool_calls"][0]
            for c in chunks
            if c["choices"][0]["index"] == k
            and "id" in c["choices"][0]["delta"].get("tool_calls", [{}])[0]
        ]
        assert [h["index"] for h in heads] == [0, 1]


# A Qwen3 answer that thinks (and rehearses the call while thinking), then calls.
THINKING = f"<think>\nI should call {AUTO}\n</think>\n\n{AUTO}"
QWEN3 = Reasoning("qwen3", inside=False, may_open=True)


def test_calls_are_read_from_the_answer_not_the_reasoning() -> None:
    body = _fmt("auto", reasoning=QWEN3).response([_out(_final(THINKING), finished=True)])
    (ch,) = body["choices"]
    assert ch["message"]["reasoning_content"] == f"I should call {AUTO}"
    assert ch["message"]["content"] == "Sure."
    assert _calls(ch["message"]) == [("weather", {"city": "Oslo"})]
    assert ch["finish_reason"] == "tool_calls"


@pytest.mark.parametrize("size", [1, 5, 1000])
def test_streamed_reasoning_then_calls_assemble_in_the_openai_client(size: int) -> None:
    pieces = [THINKING[i : i + size] for i in range(0, len(THINKING), size)]
    state = ChatCompletionStreamState(input_tools=TOOLS)  # type: ignore[arg-type]
    chunks = _stream(_fmt("auto", reasoning=QWEN3), pieces)
    for chunk in chunks:
        state.handle_chunk(ChatCompletionChunk.model_validate(chunk))
    (choice_out,) = state.get_final_completion().choices
    message = choice_out.message
    assert choice_out.finish_reason == "tool_calls"
    assert message.model_extra == {"reasoning_content": f"I should call {AUTO}"}
    assert message.content == "Sure."
    got = [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or []]
    assert got == [("weather", {"city": "Oslo"})]

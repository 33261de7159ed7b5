"""OpenAI response bodies from real engine outputs (no server): whole responses, SSE chunks,
usage, logprobs, n > 1 and several prompts."""

from __future__ import annotations

import json

import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from cluster.http.format import SSE_DONE, Formatter, request_usage, sse
from cluster.ingress.output_parsing import Reasoning
from cluster.ingress.token_text import TokenStrings
from workers.outputs import CompletionOutput, RequestOutput

TOKENS = TokenStrings(lambda ids: f"<{ids[0]}>")


def _fmt(
    kind: str, n: int = 1, top: int | None = None, reasoning: Reasoning | None = None
) -> Formatter:
    return Formatter(kind, "id-1", "kvray-demo", n, top, TOKENS, reasoning=reasoning)


def _final(*completions: CompletionOutput, prompt: int = 3, cached: int = 0) -> RequestOutput:
    return RequestOutput(
        request_id="id-1",
        prompt=None,
        prompt_token_ids=list(range(prompt)),
        outputs=list(completions),
        finished=True,
        num_cached_tokens=cached,
    )


def _delta(*completions: CompletionOutput) -> RequestOutput:
    return RequestOutput("id-1", None, [], list(completions))


def _frames(frames: list[str]) -> list[dict]:
    assert all(f.startswith("data: ") and f.endswith("\n\n") for f in frames)
    return [json.loads(f[len("data: ") :]) for f in frames]


def test_completion_response_n2_sorted_with_usage() -> None:
    out = _final(
        CompletionOutput(1, "b", [8], "stop"),
        CompletionOutput(0, "aa", [5, 6], "length"),
        cached=2,
    )
    body = _fmt("completion", n=2).response([out])
    assert body["object"] == "text_completion" and body["id"] == "id-1"
    assert body["model"] == "kvray-demo" and isinstance(body["created"], int)
    assert [(c["index"], c["text"], c["finish_reason"]) for c in body["choices"]] == [
        (0, "aa", "length"),
        (1, "b", "stop"),
    ]
    assert all(c["logprobs"] is None for c in body["choices"])
    assert body["usage"] == {
        "prompt_tokens": 3,
        "completion_tokens": 3,
        "total_tokens": 6,
        "prompt_tokens_details": {"cached_tokens": 2},
    }


def test_several_prompts_number_their_choices_by_prompt_then_sample() -> None:
    outs = [
        _final(CompletionOutput(0, "x", [1], "stop"), CompletionOutput(1, "y", [2], "stop")),
        _final(CompletionOutput(0, "z", [3], "stop"), CompletionOutput(1, "w", [4], "stop")),
    ]
    body = _fmt("completion", n=2).response(outs)
    assert [(c["index"], c["text"]) for c in body["choices"]] == [
        (0, "x"),
        (1, "y"),
        (2, "z"),
        (3, "w"),
    ]
    assert body["usage"]["prompt_tokens"] == 6 and body["usage"]["completion_tokens"] == 4
    assert request_usage(outs) == body["usage"]


def test_chat_response_is_an_assistant_message() -> None:
    body = _fmt("chat").response([_final(CompletionOutput(0, "hi there", [4, 5], "stop"))])
    assert body["object"] == "chat.completion"
    (choice,) = body["choices"]
    # Without a reasoning parser a message has no reasoning field, whatever it holds.
    assert choice["message"] == {"role": "assistant", "content": "hi there"}
    assert choice["finish_reason"] == "stop" and choice["logprobs"] is None


def test_completion_logprobs_tokens_offsets_and_top() -> None:
    lps = [{5: -0.1, 9: -2.0}, {6: -0.5, 7: -0.7, 8: -3.0}]
    out = _final(CompletionOutput(0, "ab", [5, 6], "length", logprobs=lps))
    (choice,) = _fmt("completion", top=1).response([out])["choices"]
    assert choice["logprobs"] == {
        "tokens": ["<5>", "<6>"],
        "token_logprobs": [-0.1, -0.5],
        "top_logprobs": [{"<5>": -0.1}, {"<6>": -0.5}],
        "text_offset": [0, 3],
    }
    # logprobs=0: the chosen token's logprob, no alternatives.
    (choice,) = _fmt("completion", top=0).response([out])["choices"]
    assert choice["logprobs"]["top_logprobs"] == [None, None]


def test_chat_logprobs_content_entries() -> None:
    out = _final(CompletionOutput(0, "a", [7], "stop", logprobs=[{7: -0.25, 3: -1.5}]))
    (choice,) = _fmt("chat", top=2).response([out])["choices"]
    (entry,) = choice["logprobs"]["content"]
    assert entry["token"] == "<7>" and entry["logprob"] == -0.25
    assert entry["bytes"] == list(b"<7>")
    assert [(t["token"], t["logprob"]) for t in entry["top_logprobs"]] == [
        ("<7>", -0.25),
        ("<3>", -1.5),
    ]


def test_completion_chunks_carry_deltas_and_finish_once() -> None:
    fmt = _fmt("completion", n=2)
    first = _delta(
        CompletionOutput(0, delta_text="a", delta_token_ids=[1]),
        CompletionOutput(1, delta_text="", delta_token_ids=[]),  # nothing visible yet
    )
    (chunk,) = _frames(fmt.chunks(first))
    assert chunk["object"] == "text_completion"
    assert chunk["choices"] == [{"index": 0, "text": "a", "logprobs": None, "finish_reason": None}]
    done0 = _delta(
        CompletionOutput(0, finish_reason="stop", delta_text="b", delta_token_ids=[2]),
        CompletionOutput(1, delta_text="x", delta_token_ids=[3]),
    )
    assert [c["choices"][0]["finish_reason"] for c in _frames(fmt.chunks(done0))] == [
        "stop",
        None,
    ]
    final = _final(
        CompletionOutput(0, "ab", [1, 2], "stop"),
        CompletionOutput(1, "xy", [3, 4], "length", delta_text="y", delta_token_ids=[4]),
    )
    # Choice 0 already finished: only choice 1's last delta and finish go out.
    (last,) = _frames(fmt.chunks(final))
    assert last["choices"] == [
        {"index": 1, "text": "y", "logprobs": None, "finish_reason": "length"}
    ]


def test_chunks_of_a_second_prompt_are_numbered_after_the_first() -> None:
    fmt = _fmt("completion", n=2)
    out = _delta(CompletionOutput(1, delta_text="q", delta_token_ids=[9]))
    (chunk,) = _frames(fmt.chunks(out, prompt_index=1))
    assert chunk["choices"][0]["index"] == 3


def test_chat_chunks_start_with_the_role_then_content() -> None:
    fmt = _fmt("chat")
    (first,) = _frames(fmt.chunks(_delta(CompletionOutput(0))))  # empty: still the role
    assert first["object"] == "chat.completion.chunk"
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    (nxt,) = _frames(fmt.chunks(_delta(CompletionOutput(0, delta_text="hi"))))
    assert nxt["choices"][0]["delta"] == {"content": "hi"}
    assert fmt.chunks(_delta(CompletionOutput(0))) == []  # nothing new: no frame


def test_streamed_logprobs_cover_each_delta_and_offsets_continue() -> None:
    fmt = _fmt("completion", top=1)
    a = _delta(CompletionOutput(0, delta_text="x", delta_token_ids=[5], delta_logprobs=[{5: -1.0}]))
    b = _delta(CompletionOutput(0, delta_text="y", delta_token_ids=[6], delta_logprobs=[{6: -2.0}]))
    (ca,) = _frames(fmt.chunks(a))
    (cb,) = _frames(fmt.chunks(b))
    assert ca["choices"][0]["logprobs"]["tokens"] == ["<5>"]
    assert cb["choices"][0]["logprobs"]["token_logprobs"] == [-2.0]
    assert cb["choices"][0]["logprobs"]["text_offset"] == [3]  # after "<5>"


def test_usage_chunk_has_no_choices() -> None:
    fmt = _fmt("chat")
    (chunk,) = _frames([fmt.usage_chunk([_final(CompletionOutput(0, "a", [1, 2], "stop"))])])
    assert chunk["choices"] == [] and chunk["object"] == "chat.completion.chunk"
    assert chunk["usage"]["completion_tokens"] == 2 and chunk["usage"]["total_tokens"] == 5


@pytest.mark.parametrize("text", ["plain", "ünïcödé 🙂", 'quote " and \n newline'])
def test_sse_frames_are_compact_json(text: str) -> None:
    frame = sse({"text": text})
    assert (
        frame
        == f"data: {json.dumps({'text': text}, separators=(',', ':'), ensure_ascii=False)}\n\n"
    )
    assert json.loads(frame[6:]) == {"text": text}
    assert SSE_DONE == "data: [DONE]\n\n"


# -- reasoning (a reasoning parser on) --------------------------------------------------------

QWEN3 = Reasoning("qwen3", inside=False, may_open=True)
R1 = Reasoning("deepseek_r1", inside=True)
THOUGHT = "<think>\nTwo and two.\n</think>\n\nFour."


@pytest.mark.parametrize(
    ("reasoning", "text", "thought", "content", "finish"),
    [
        (QWEN3, THOUGHT, "Two and two.", "Four.", "stop"),
        (QWEN3, "Four.", None, "Four.", "stop"),  # answered without thinking
        (R1, "Two and two.</think>Four.", "Two and two.", "Four.", "stop"),
        (R1, "Two and", "Two and", None, "length"),  # cut off while thinking
    ],
)
def test_chat_messages_carry_the_reasoning_apart(
    reasoning: Reasoning, text: str, thought: str | None, content: str | None, finish: str
) -> None:
    out = _final(CompletionOutput(0, text, [1, 2], finish))
    body = _fmt("chat", reasoning=reasoning).response([out])
    (choice,) = body["choices"]
    assert choice["message"] == {
        "role": "assistant",
        "content": content,
        "reasoning_content": thought,
    }
    assert choice["finish_reason"] == finish
    parsed = ChatCompletion.model_validate(body).choices[0].message
    assert parsed.content == content and parsed.model_extra == {"reasoning_content": thought}


def _chat_stream(fmt: Formatter, text: str, size: int, n: int = 1) -> list[dict]:
    pieces = [text[i : i + size] for i in range(0, len(text), size)]
    frames: list[str] = []
    for i, piece in enumerate(pieces):
        last = i == len(pieces) - 1
        cs = [
            CompletionOutput(k, "", [], "stop" if last else None, delta_text=piece)
            for k in range(n)
        ]
        frames += fmt.chunks(RequestOutput("id-1", None, [1], cs, finished=last))
    return _frames(frames)


@pytest.mark.parametrize("size", [1, 3, 1000])
def test_streamed_reasoning_comes_first_then_the_content(size: int) -> None:
    chunks = _chat_stream(_fmt("chat", n=2, reasoning=QWEN3), THOUGHT, size, n=2)
    for k in (0, 1):
        deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"][0]["index"] == k]
        assert deltas[0]["role"] == "assistant"
        kinds = [key for d in deltas for key in d if key != "role" and d[key]]
        assert kinds == sorted(kinds, reverse=True)  # reasoning_content, then content
        assert "".join(d.get("reasoning_content", "") for d in deltas) == "Two and two."
        assert "".join(d.get("content", "") for d in deltas) == "Four."
    state = ChatCompletionStreamState()
    for chunk in chunks:
        state.handle_chunk(ChatCompletionChunk.model_validate(chunk))
    for choice in state.get_final_completion().choices:
        assert choice.message.content == "Four." and choice.finish_reason == "stop"
        assert choice.message.model_extra == {"reasoning_content": "Two and two."}


def test_streamed_logprobs_stay_with_their_delta_while_reasoning() -> None:
    fmt = _fmt("chat", top=0, reasoning=R1)
    a = _delta(CompletionOutput(0, delta_text="hm", delta_token_ids=[5], delta_logprobs=[{5: -1}]))
    (ca,) = _frames(fmt.chunks(a))
    assert ca["choices"][0]["delta"] == {"role": "assistant", "reasoning_content": "hm"}
    assert ca["choices"][0]["logprobs"]["content"][0]["token"] == "<5>"
    # A delta that is only the marker shows nothing but still carries its logprobs.
    b = _delta(
        CompletionOutput(0, delta_text="</think>", delta_token_ids=[6], delta_logprobs=[{6: -2}])
    )
    (cb,) = _frames(fmt.chunks(b))
    assert cb["choices"][0]["delta"] == {} and cb["choices"][0]["logprobs"] is not None

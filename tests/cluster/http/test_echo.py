"""echo, scoring-only requests and prompt logprobs on the HTTP API, without a server: the
request fields into SamplingParams, and answers built from hand-made engine outputs."""

from __future__ import annotations

import asyncio
import json
import math
from pathlib import Path
from typing import Any

import pytest

from cluster.errors import InvalidRequestError
from cluster.http.echo import PromptEcho, prompt_echo, text_offsets
from cluster.http.format import Formatter
from cluster.http.protocol import ChatCompletionRequest, CompletionRequest
from cluster.ingress.prepare import Outputs, Prepared
from cluster.ingress.prompts import Prompts
from cluster.ingress.token_text import TokenStrings
from workers.inputs import InputChecker
from workers.outputs import CompletionOutput, RequestOutput

TOKENS = TokenStrings(lambda ids: f"<{ids[0]}>")
PROMPT_IDS = [5, 6, 7]
# Position 0 has nothing before it; 6 is the top token at 1; 7 ranks second at 2.
PROMPT_LPS: list[Any] = [None, {6: -0.5, 9: -1.5}, {8: -0.25, 7: -2.0}]
ECHO = PromptEcho(("ab c",), (tuple(PROMPT_IDS),), ((0, 1, 2),), scoring_only=False)


def _final(*completions: CompletionOutput, prompt_lps: Any = PROMPT_LPS) -> RequestOutput:
    return RequestOutput(
        "id-1", None, list(PROMPT_IDS), list(completions), True, prompt_logprobs=prompt_lps
    )


def _fmt(
    echo: PromptEcho | None = ECHO, top: int | None = 1, n: int = 1, prompt_lps: int | None = None
) -> Formatter:
    return Formatter(
        "completion", "id-1", "m", n, top, TOKENS, echo=echo, prompt_logprobs=prompt_lps
    )


def _frames(frames: list[str]) -> list[dict]:
    return [json.loads(f[len("data: ") :]) for f in frames]


# -- request fields -------------------------------------------------------------------------


def test_echo_with_logprobs_asks_the_engine_for_prompt_logprobs() -> None:
    p = CompletionRequest(prompt="hi", echo=True, logprobs=3).sampling_params()
    assert p.prompt_logprobs == 3 and p.logprobs == 3
    assert CompletionRequest(prompt="hi", echo=True).sampling_params().prompt_logprobs is None
    both = CompletionRequest(prompt="hi", echo=True, logprobs=2, prompt_logprobs=5)
    assert both.sampling_params().prompt_logprobs == 5  # enough for both views
    assert CompletionRequest(prompt="hi", prompt_logprobs=0).sampling_params().prompt_logprobs == 0


def test_max_tokens_0_with_echo_scores_the_prompt_only() -> None:
    body = CompletionRequest(prompt="hi", echo=True, max_tokens=0, logprobs=1)
    assert body.scoring_only and body.sampling_params().max_tokens == 1
    with pytest.raises(InvalidRequestError) as err:
        CompletionRequest(prompt="hi", max_tokens=0).sampling_params()
    assert err.value.param == "max_tokens" and "echo" in err.value.message


@pytest.mark.parametrize(
    "body",
    [
        {"prompt_logprobs": 21},
        {"prompt_logprobs": -1},
        {"prompt_logprobs": 2, "stream": True},
        {"prompt_logprobs": -1, "stream": True},
    ],
)
def test_bad_prompt_logprobs_name_the_field(body: dict[str, Any]) -> None:
    for request in (
        CompletionRequest(prompt="hi", **body),
        ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], **body),
    ):
        with pytest.raises(InvalidRequestError) as err:
            request.sampling_params()
        assert err.value.param == "prompt_logprobs"


@pytest.mark.parametrize("asked", [-1, 21])
def test_echo_does_not_hide_bad_prompt_logprobs(asked: int) -> None:
    # echo with logprobs raises the engine's prompt_logprobs to cover both views: a bad value
    # the client asked for is still refused (by SamplingParams' one range check).
    with pytest.raises(InvalidRequestError) as err:
        CompletionRequest(
            prompt="hi", echo=True, logprobs=2, prompt_logprobs=asked
        ).sampling_params()
    assert err.value.param == "prompt_logprobs" and f"got {asked}" in err.value.message


def test_a_stream_takes_prompt_logprobs_0_and_computes_none() -> None:
    body = CompletionRequest(prompt="hi", prompt_logprobs=0, stream=True)
    assert body.sampling_params().prompt_logprobs is None
    # echo's own prompt logprobs stream (in the first chunk).
    echoed = CompletionRequest(prompt="hi", echo=True, logprobs=2, stream=True)
    assert echoed.sampling_params().prompt_logprobs == 2


# -- whole answers --------------------------------------------------------------------------


def test_echo_puts_the_prompt_before_the_completion_with_its_logprobs() -> None:
    out = _final(CompletionOutput(0, "xy", [3, 4], "length", logprobs=[{3: -0.1}, {4: -0.2}]))
    body = _fmt().response([out])
    (choice,) = body["choices"]
    assert choice["text"] == "ab cxy" and choice["finish_reason"] == "length"
    lps = choice["logprobs"]
    assert lps["tokens"] == ["<5>", "<6>", "<7>", "<3>", "<4>"]
    assert lps["token_logprobs"] == [None, -0.5, -2.0, -0.1, -0.2]
    assert lps["top_logprobs"] == [
        None,
        {"<6>": -0.5},
        {"<8>": -0.25},
        {"<3>": -0.1},
        {"<4>": -0.2},
    ]
    # The prompt's tokens where they start in its text, the completion's after all of it.
    assert lps["text_offset"] == [0, 1, 2, 4, 7]
    assert body["usage"]["completion_tokens"] == 2 and body["usage"]["prompt_tokens"] == 3
    assert "prompt_logprobs" not in choice


def test_echo_without_logprobs_is_text_only() -> None:
    out = _final(CompletionOutput(0, "xy", [3, 4], "stop"), prompt_lps=None)
    (choice,) = _fmt(top=None).response([out])["choices"]
    assert choice["text"] == "ab cxy" and choice["logprobs"] is None


def test_prompt_logprobs_not_computed_leave_the_prompt_positions_null() -> None:
    out = _final(CompletionOutput(0, "x", [3], "stop", logprobs=[{3: -0.1}]), prompt_lps=None)
    lps = _fmt().response([out])["choices"][0]["logprobs"]
    assert lps["token_logprobs"] == [None, None, None, -0.1]


def test_scoring_only_answers_the_prompt_alone() -> None:
    echo = PromptEcho(ECHO.texts, ECHO.token_ids, ECHO.offsets, scoring_only=True)
    out = _final(CompletionOutput(0, "x", [2], "stop", logprobs=[{2: -0.1}]))
    body = _fmt(echo=echo).response([out])
    (choice,) = body["choices"]
    assert choice["text"] == "ab c" and choice["finish_reason"] == "length"
    assert choice["logprobs"]["token_logprobs"] == [None, -0.5, -2.0]
    assert body["usage"]["completion_tokens"] == 0 and body["usage"]["total_tokens"] == 3


def test_each_prompt_and_sample_echoes_its_own_prompt() -> None:
    echo = PromptEcho(("p0", "p1"), ((1,), (2, 3)), None, scoring_only=False)
    outs = [
        RequestOutput(
            "a", None, [1], [CompletionOutput(0, "a", [9]), CompletionOutput(1, "b", [9])]
        ),
        RequestOutput(
            "b", None, [2, 3], [CompletionOutput(0, "c", [9]), CompletionOutput(1, "d", [9])]
        ),
    ]
    body = _fmt(echo=echo, top=None, n=2).response(outs)
    assert [c["text"] for c in body["choices"]] == ["p0a", "p0b", "p1c", "p1d"]


def test_vllm_prompt_logprobs_per_completion_choice() -> None:
    out = _final(CompletionOutput(0, "x", [3], "stop"))
    (choice,) = _fmt(echo=None, top=None, prompt_lps=1).response([out])["choices"]
    first, second, third = choice["prompt_logprobs"]
    assert first is None
    assert second == {"6": {"logprob": -0.5, "rank": 1, "decoded_token": "<6>"}}
    # The prompt's token first, then the top 1 (the engine ranked 1: token 7's rank unknown).
    assert list(third) == ["7", "8"]
    assert third["7"] == {"logprob": -2.0, "rank": None, "decoded_token": "<7>"}
    assert third["8"]["rank"] == 1


def test_vllm_prompt_logprobs_rank_what_the_engine_ranked() -> None:
    # echo's logprobs=2 made the engine rank 2 per position: token 7 is known second.
    out = _final(CompletionOutput(0, "x", [3], "stop"))
    (choice,) = _fmt(top=2, prompt_lps=0).response([out])["choices"]
    assert choice["prompt_logprobs"][2] == {
        "7": {"logprob": -2.0, "rank": 2, "decoded_token": "<7>"}
    }


def test_chat_prompt_logprobs_are_top_level_and_finite() -> None:
    lps = [None, {6: -math.inf}, {7: -0.5}]
    out = _final(CompletionOutput(0, "hi", [3], "stop"), prompt_lps=lps)
    fmt = Formatter("chat", "id", "m", 1, None, TOKENS, prompt_logprobs=0)
    body = fmt.response([out])
    assert body["prompt_logprobs"][1] == {
        "6": {"logprob": -9999.0, "rank": None, "decoded_token": "<6>"}
    }
    assert "prompt_logprobs" not in body["choices"][0]
    json.dumps(body, allow_nan=False)  # valid JSON: no Infinity


# -- streaming ------------------------------------------------------------------------------


def test_a_stream_echoes_the_prompt_and_its_logprobs_in_the_first_chunk() -> None:
    fmt = _fmt()
    first = RequestOutput(
        "id-1",
        None,
        [],
        [CompletionOutput(0, delta_text="x", delta_token_ids=[3], delta_logprobs=[{3: -0.1}])],
        prompt_logprobs=PROMPT_LPS,
    )
    last = _final(
        CompletionOutput(
            0,
            "xy",
            [3, 4],
            "length",
            delta_text="y",
            delta_token_ids=[4],
            delta_logprobs=[{4: -0.2}],
        )
    )
    (one,) = _frames(fmt.chunks(first))
    (two,) = _frames(fmt.chunks(last))
    c1, c2 = one["choices"][0], two["choices"][0]
    assert c1["text"] == "ab cx" and c1["finish_reason"] is None
    assert c1["logprobs"]["token_logprobs"] == [None, -0.5, -2.0, -0.1]
    assert c1["logprobs"]["text_offset"] == [0, 1, 2, 4]
    assert c2["text"] == "y" and c2["finish_reason"] == "length"
    assert c2["logprobs"]["tokens"] == ["<4>"] and c2["logprobs"]["text_offset"] == [7]


def test_a_scoring_only_stream_is_one_chunk_of_prompt() -> None:
    echo = PromptEcho(ECHO.texts, ECHO.token_ids, ECHO.offsets, scoring_only=True)
    fmt = _fmt(echo=echo)
    out = _final(
        CompletionOutput(
            0, "x", [2], "stop", delta_text="x", delta_token_ids=[2], delta_logprobs=[{2: -1.0}]
        )
    )
    (frame,) = _frames(fmt.chunks(out))
    choice = frame["choices"][0]
    assert choice["text"] == "ab c" and choice["finish_reason"] == "length"
    assert choice["logprobs"]["token_logprobs"] == [None, -0.5, -2.0]
    (usage,) = _frames([fmt.usage_chunk([out])])
    assert usage["usage"]["completion_tokens"] == 0


# -- the ingress side: texts and offsets ----------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer(demo_dir: Path) -> Any:
    from workers.tokenizer import Tokenizer

    return Tokenizer.from_pretrained(demo_dir)


@pytest.mark.parametrize("text", ["Hello world, again.", "café 日本語 ☃ ok", "a<|im_start|>b"])
def test_text_offsets_are_where_each_token_starts(tokenizer: Any, text: str) -> None:
    ids = tokenizer.encode(text)
    offsets = text_offsets(tokenizer, ids, text)
    assert offsets[0] == 0 and offsets == sorted(offsets) and len(offsets) == len(ids)
    # Each token's own text, where it decodes whole, is at its offset.
    for tid, at in zip(ids, offsets, strict=True):
        piece = tokenizer.decode([tid], skip_special_tokens=False)
        if "\ufffd" not in piece:
            assert text[at : at + len(piece)] == piece


def test_text_offsets_put_tokens_before_the_text_at_0(tokenizer: Any) -> None:
    bos = tokenizer.encode("<|endoftext|>")
    ids = bos + tokenizer.encode("hi there")
    offsets = text_offsets(tokenizer, ids, "hi there")
    assert offsets[: len(bos) + 1] == [0] * (len(bos) + 1) and offsets[-1] < len("hi there")


def _echo(body: CompletionRequest, tokenizer: Any) -> PromptEcho | None:
    checker = InputChecker(vocab_size=tokenizer.vocab_size, max_model_len=2048)
    params = body.sampling_params()
    inputs = tuple(
        checker.check(tokenizer.encode(p) if isinstance(p, str) else p, params)
        for p in body.prompts()
    )
    prepared = Prepared(params, inputs, Outputs(None, None))
    return asyncio.run(prompt_echo(body, prepared, Prompts(tokenizer)))


def test_prompt_echo_keeps_text_prompts_and_decodes_token_id_prompts(tokenizer: Any) -> None:
    text = _echo(CompletionRequest(prompt="plain text", echo=True), tokenizer)
    assert text is not None and text.texts == ("plain text",) and text.offsets is None
    ids = tokenizer.encode("<|im_start|>user")
    body = CompletionRequest(prompt=[[1, 2], ids], echo=True, logprobs=1, max_tokens=0)
    echo = _echo(body, tokenizer)
    assert echo is not None and echo.scoring_only
    assert echo.texts[1] == "<|im_start|>user" and echo.token_ids[1] == tuple(ids)
    assert echo.texts[0] == tokenizer.decode([1, 2], skip_special_tokens=False)
    assert echo.offsets is not None and echo.offsets[1][:2] == (0, len("<|im_start|>"))
    assert _echo(CompletionRequest(prompt="x"), tokenizer) is None

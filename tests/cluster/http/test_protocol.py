"""OpenAI request bodies -> the engine's SamplingParams, and the fields their errors name
(no server: the models are checked as FastAPI would, through pydantic)."""

from __future__ import annotations

from typing import Any

import pydantic
import pytest

from cluster.errors import InvalidRequestError
from cluster.http.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    TokenizeRequest,
)
from workers.outputs import RequestOutputKind
from workers.sampling_params import SamplingParams

USER = [{"role": "user", "content": "hi"}]


def test_completion_defaults_are_the_openai_ones() -> None:
    params = CompletionRequest(prompt="hi").sampling_params()
    assert params == SamplingParams(max_tokens=16, output_kind=RequestOutputKind.FINAL_ONLY)
    assert CompletionRequest(prompt="hi", stream=True).sampling_params().output_kind is (
        RequestOutputKind.DELTA
    )


def test_chat_leaves_max_tokens_to_the_context_and_prefers_max_completion_tokens() -> None:
    assert ChatCompletionRequest(messages=USER).sampling_params().max_tokens is None
    both = ChatCompletionRequest(messages=USER, max_tokens=9, max_completion_tokens=4)
    assert both.sampling_params().max_tokens == 4
    assert ChatCompletionRequest(messages=USER, max_tokens=9).sampling_params().max_tokens == 9


def test_every_sampling_field_reaches_sampling_params() -> None:
    body = CompletionRequest(
        prompt=[1, 2],
        n=2,
        max_tokens=7,
        min_tokens=2,
        temperature=0.5,
        top_p=0.9,
        top_k=4,
        min_p=0.1,
        seed=3,
        stop="END",
        stop_token_ids=[5],
        ignore_eos=True,
        include_stop_str_in_output=True,
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        repetition_penalty=1.2,
        skip_special_tokens=False,
        logprobs=2,
        stream=True,
    )
    assert body.sampling_params() == SamplingParams(
        n=2,
        max_tokens=7,
        min_tokens=2,
        temperature=0.5,
        top_p=0.9,
        top_k=4,
        min_p=0.1,
        seed=3,
        stop=["END"],
        stop_token_ids=[5],
        ignore_eos=True,
        include_stop_str_in_output=True,
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        repetition_penalty=1.2,
        skip_special_tokens=False,
        logprobs=2,
        output_kind=RequestOutputKind.DELTA,
    )


def test_chat_logprobs_are_top_logprobs_when_asked() -> None:
    assert ChatCompletionRequest(messages=USER).sampling_params().logprobs is None
    on = ChatCompletionRequest(messages=USER, logprobs=True, top_logprobs=3)
    assert on.sampling_params().logprobs == 3
    assert ChatCompletionRequest(messages=USER, logprobs=True).sampling_params().logprobs == 0


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"temperature": -1}, "temperature"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": 0}, "top_k"),
        ({"n": 0}, "n"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"logprobs": 50}, "logprobs"),
        ({"presence_penalty": 3}, "presence_penalty"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"min_tokens": 9, "max_tokens": 2}, "min_tokens"),
        ({"prompt_logprobs": 21}, "prompt_logprobs"),
        ({"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
        ({"suffix": "x"}, "suffix"),
        ({"best_of": 3}, "best_of"),
        ({"logit_bias": {"5": 1.0}}, "logit_bias"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
    ],
)
def test_completion_errors_name_the_field(body: dict[str, Any], field: str) -> None:
    with pytest.raises(InvalidRequestError) as err:
        CompletionRequest(prompt="hi", **body).sampling_params()
    assert err.value.param == field and err.value.http_status == 400
    assert err.value.message


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"tools": [{"type": "function"}]}, "tools[0].function"),
        ({"response_format": {"type": "xml"}}, "response_format.type"),
        ({"max_completion_tokens": 0}, "max_tokens"),
    ],
)
def test_chat_errors_name_the_field(body: dict[str, Any], field: str) -> None:
    with pytest.raises(InvalidRequestError) as err:
        ChatCompletionRequest(messages=USER, **body).sampling_params()
    assert err.value.param == field


def test_prompts_are_a_batch() -> None:
    assert CompletionRequest(prompt="a").prompts() == ["a"]
    assert CompletionRequest(prompt=["a", "b"]).prompts() == ["a", "b"]
    assert CompletionRequest(prompt=[1, 2]).prompts() == [[1, 2]]
    assert CompletionRequest(prompt=[[1], [2, 3]]).prompts() == [[1], [2, 3]]


def test_body_shape_errors_come_from_pydantic() -> None:
    # FastAPI turns these into a 400 naming the field (cluster.http.ingress.validation_to_invalid).
    for body in ({"prompt": []}, {}, {"prompt": {"text": "hi"}}):
        with pytest.raises(pydantic.ValidationError):
            CompletionRequest(**body)
    with pytest.raises(pydantic.ValidationError):
        ChatCompletionRequest(messages=[])
    with pytest.raises(pydantic.ValidationError):
        ChatCompletionRequest(messages=[{"role": "wizard", "content": "x"}])


def test_chat_content_parts_become_text_for_the_template() -> None:
    msg = ChatMessage(
        role="user", content=[{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    )
    assert msg.as_template_input() == {"role": "user", "content": "ab"}
    assert ChatMessage(role="assistant").as_template_input() == {"role": "assistant", "content": ""}
    with pytest.raises(InvalidRequestError) as err:
        ChatMessage(role="user", content=[{"type": "image_url"}]).as_template_input()
    assert err.value.param == "messages"


def test_unknown_fields_are_ignored() -> None:
    body = CompletionRequest(prompt="hi", user="u1", service_tier="auto")
    assert body.sampling_params().max_tokens == 16
    assert TokenizeRequest(prompt="x", whatever=1).prompt == "x"


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("frequency_penalty", False),  # found by the schema fuzzer: lax mode read it as 0.0
        ("temperature", "0.5"),
        ("max_tokens", True),
        ("n", 1.0),
        ("stream", 1),
        ("prompt", [1, True]),  # token ids
        ("stop_token_ids", [False]),
    ],
)
def test_json_types_are_not_coerced(field: str, value: Any) -> None:
    with pytest.raises(pydantic.ValidationError) as err:
        CompletionRequest.model_validate({"prompt": "hi", field: value})
    assert err.value.errors()[0]["loc"][0] == field


def test_json_integers_are_numbers() -> None:
    body = CompletionRequest.model_validate({"prompt": [5, 6], "temperature": 1, "top_p": 1})
    assert body.temperature == 1.0 and body.prompts() == [[5, 6]]


def test_chat_template_kwargs_reach_the_template_and_must_be_an_object() -> None:
    from cluster.http.protocol import template_kwargs
    from cluster.ingress.limits import DEFAULT_LIMITS

    body = ChatCompletionRequest(messages=USER, chat_template_kwargs={"enable_thinking": False})
    assert body.prompt_input(DEFAULT_LIMITS).template_kwargs == {"enable_thinking": False}
    assert ChatCompletionRequest(messages=USER).prompt_input(DEFAULT_LIMITS).template_kwargs is None
    kw = {"enable_thinking": True}
    assert TokenizeRequest(messages=USER, chat_template_kwargs=kw).chat_template_kwargs == kw
    with pytest.raises(pydantic.ValidationError) as err:
        ChatCompletionRequest.model_validate({"messages": USER, "chat_template_kwargs": [1]})
    assert err.value.errors()[0]["loc"][0] == "chat_template_kwargs"
    with pytest.raises(InvalidRequestError) as bad:
        template_kwargs({1: "x"})
    assert bad.value.param == "chat_template_kwargs"

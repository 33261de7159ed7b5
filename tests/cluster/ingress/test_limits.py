"""Request bounds at the ingress (RequestLimits): each is a ServeConfig value, and a request
over one is InvalidRequestError naming the field and the limit, for HTTP and gRPC alike."""

from __future__ import annotations

from dataclasses import fields

import grpc
import pytest

from cluster.config import ServeConfig
from cluster.errors import InvalidRequestError
from cluster.grpc_api import convert as conv
from cluster.grpc_api.client import build_generate_request
from cluster.grpc_api.servicer import status_for
from cluster.http.protocol import ChatCompletionRequest, CompletionRequest
from cluster.ingress import checks
from cluster.ingress.limits import DEFAULT_LIMITS, RequestLimits
from kvray.v1 import llm_pb2

SMALL = RequestLimits(
    max_n=4,
    max_stop_strings=2,
    max_stop_string_chars=5,
    max_stop_token_ids=3,
    max_prompts_per_request=2,
    max_chat_messages=2,
)


def test_defaults_are_serve_configs() -> None:
    assert RequestLimits.from_config(ServeConfig()) == DEFAULT_LIMITS
    config = ServeConfig.from_flat(**{f.name: 7 for f in fields(RequestLimits)})
    assert RequestLimits.from_config(config) == RequestLimits(
        **{f.name: 7 for f in fields(RequestLimits)}
    )


@pytest.mark.parametrize(
    "name", [f.name for f in fields(RequestLimits)] + ["max_request_body_bytes"]
)
def test_each_bound_is_a_validated_config_value_with_a_flag(name: str) -> None:
    with pytest.raises(ValueError, match=rf"^{name} "):
        ServeConfig.from_args({name: 0})
    flag = next(s for _, f, s in ServeConfig.settings() if f.name == name)
    assert flag.help


@pytest.mark.parametrize(
    ("kwargs", "field", "setting"),
    [
        ({"n": 5}, "n", "max_n"),
        ({"stop": ["a", "b", "c"]}, "stop", "max_stop_strings"),
        ({"stop": "abcdef"}, "stop", "max_stop_string_chars"),
        ({"stop": ["ok", "abcdef"]}, "stop", "max_stop_string_chars"),
        ({"stop_token_ids": [1, 2, 3, 4]}, "stop_token_ids", "max_stop_token_ids"),
    ],
)
def test_over_a_sampling_bound_names_field_and_limit(
    kwargs: dict, field: str, setting: str
) -> None:
    with pytest.raises(InvalidRequestError) as err:
        checks.sampling_params(kwargs, stream=False, limits=SMALL)
    assert err.value.param == field
    assert err.value.message.startswith(f"{field} ") and setting in err.value.message
    limit = getattr(SMALL, setting)
    assert f"limit of {limit} " in err.value.message


def test_at_the_bounds_is_accepted() -> None:
    params = checks.sampling_params(
        {"n": 4, "stop": ["abcde", "x"], "stop_token_ids": [1, 2, 3]}, stream=False, limits=SMALL
    )
    assert params.n == 4 and params.stop == ["abcde", "x"]


def test_the_default_bounds_apply_without_limits() -> None:
    with pytest.raises(InvalidRequestError, match="max_n") as err:
        checks.sampling_params({"n": DEFAULT_LIMITS.max_n + 1}, stream=False)
    assert err.value.param == "n"
    with pytest.raises(InvalidRequestError, match="max_stop_strings"):
        checks.sampling_params({"stop": ["s"] * 100_000}, stream=False)


def test_prompt_and_message_counts() -> None:
    SMALL.check_prompts(2)
    with pytest.raises(InvalidRequestError, match="max_prompts_per_request") as err:
        SMALL.check_prompts(3)
    assert err.value.param == "prompt"
    SMALL.check_messages(2)
    with pytest.raises(InvalidRequestError, match="max_chat_messages") as err:
        SMALL.check_messages(3)
    assert err.value.param == "messages"


def test_http_bodies_apply_the_limits() -> None:
    with pytest.raises(InvalidRequestError, match="max_n"):
        CompletionRequest(prompt="hi", n=5).sampling_params(SMALL)
    chat = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], stop=["a"] * 3)
    with pytest.raises(InvalidRequestError, match="max_stop_strings"):
        chat.sampling_params(SMALL)


def test_grpc_requests_apply_the_limits_and_name_the_path() -> None:
    req = build_generate_request("x", n=5)
    with pytest.raises(InvalidRequestError) as err:
        conv.sampling_params(req, stream=False, limits=SMALL)
    code, details = status_for(err.value, "text")
    assert code is grpc.StatusCode.INVALID_ARGUMENT
    assert details.startswith("sampling.n: ") and "max_n" in details

    req = build_generate_request("x", stop=["a", "b", "c"])
    with pytest.raises(InvalidRequestError) as err:
        conv.sampling_params(req, stream=False, limits=SMALL)
    assert status_for(err.value, "text")[1].startswith("sampling.stop: ")

    chat = llm_pb2.GenerateRequest(
        chat=llm_pb2.ChatMessages(messages=[llm_pb2.ChatMessage(role="user", content="x")] * 3)
    )
    with pytest.raises(InvalidRequestError) as err:
        conv.prompt_input(chat, SMALL)
    assert status_for(err.value, "chat")[1].startswith("chat.messages: ")
    assert "max_chat_messages" in err.value.message


def test_non_finite_floats_are_400_naming_the_field() -> None:
    with pytest.raises(InvalidRequestError) as err:
        checks.sampling_params({"temperature": float("inf")}, stream=False)
    assert err.value.param == "temperature" and err.value.http_status == 400
    req = build_generate_request("x", repetition_penalty=float("nan"))
    with pytest.raises(InvalidRequestError) as err:
        conv.sampling_params(req, stream=False)
    assert status_for(err.value, "text")[1].startswith("sampling.repetition_penalty: ")

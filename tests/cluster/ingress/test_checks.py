"""A request checked once at the ingress: SamplingParams with the output kind, token ids
against the served model, and errors that name the field (InvalidRequestError, HTTP 400)."""

from __future__ import annotations

import pickle

import pytest

from cluster.errors import InvalidRequestError
from cluster.ingress import checks
from cluster.messages import GenerateRequest
from workers.inputs import EngineInput, InputChecker
from workers.lora.request import LoRARequest
from workers.outputs import RequestOutputKind
from workers.sampling_params import SamplingParams

CHECKER = InputChecker(vocab_size=100, max_model_len=32)


def test_output_kind_follows_streaming() -> None:
    streamed = checks.sampling_params({"max_tokens": 4}, stream=True)
    assert streamed.output_kind is RequestOutputKind.DELTA and checks.is_streamed(streamed)
    whole = checks.sampling_params({"max_tokens": 4}, stream=False)
    assert whole.output_kind is RequestOutputKind.FINAL_ONLY and not checks.is_streamed(whole)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [({"top_p": 1.5}, "top_p"), ({"n": 0}, "n"), ({"temperature": -1.0}, "temperature")],
)
def test_bad_params_name_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(InvalidRequestError) as err:
        checks.sampling_params(kwargs, stream=False)
    assert err.value.param == field and field in err.value.message


def test_checked_inputs_are_the_engine_type_one_per_prompt() -> None:
    params = SamplingParams(max_tokens=4)
    lora = LoRARequest("a", 1, "/x/a")
    inp, other = checks.engine_inputs(CHECKER, [[1, 2, 3], [4]], params, lora=lora, tenant="t")
    assert isinstance(inp, EngineInput)
    assert inp.prompt_token_ids == (1, 2, 3) and inp.params is params and inp.prompt is None
    assert other == EngineInput((4,), params, lora=lora, tenant="t")
    assert checks.engine_inputs(CHECKER, [[1]], params)[0] == EngineInput((1,), params)


@pytest.mark.parametrize(
    ("ids", "max_tokens", "field", "param"),
    [
        ([100], 4, "prompt", "prompt"),  # outside the vocabulary
        ([], 4, "prompt", "prompt"),
        ([1] * 32, None, "prompt", "prompt"),  # no room to generate
        ([1] * 30, 4, "prompt", "max_tokens"),  # the parameter is what does not fit
        ([1] * 32, None, "messages", "messages"),  # chat: the rendered messages
        ([100], 4, "messages", "messages"),
        ([1] * 30, 4, "messages", "max_tokens"),
    ],
)
def test_prompt_errors_name_the_input_field(
    ids: list[int], max_tokens: int | None, field: str, param: str
) -> None:
    with pytest.raises(InvalidRequestError) as err:
        checks.engine_inputs(CHECKER, [[1], ids], SamplingParams(max_tokens=max_tokens), field)
    assert err.value.param == param
    assert err.value.http_status == 400 and err.value.grpc_code == "INVALID_ARGUMENT"


def test_the_message_to_llm_server_pickles() -> None:
    params = checks.sampling_params({"max_tokens": 4, "stop": ["x"]}, stream=True)
    (inp,) = checks.engine_inputs(CHECKER, [[4, 5]], params, lora=LoRARequest("a", 1, "/x/a"))
    req = GenerateRequest("r-1", inp, routing_key="k")
    back = pickle.loads(pickle.dumps(req))
    assert back == req and back.input.params.output_kind is RequestOutputKind.DELTA
    with pytest.raises(AttributeError):
        req.request_id = "other"  # type: ignore[misc]

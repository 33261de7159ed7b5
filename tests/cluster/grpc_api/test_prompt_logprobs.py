"""GenerateRequest.prompt_logprobs: the client sets it, it reaches SamplingParams (a bad value
names it), and responses carry the prompt's logprobs once (no server)."""

from __future__ import annotations

import grpc
import pytest

from cluster.errors import InvalidRequestError
from cluster.grpc_api import convert as conv
from cluster.grpc_api.client import build_generate_request
from cluster.grpc_api.servicer import status_for
from workers.outputs import CompletionOutput, RequestOutput

PROMPT = [5, 6, 7]
PROMPT_LPS = [None, {6: -0.5, 9: -0.25}, {7: -1.0}]
CTX = conv.ResponseContext(
    "r", "m", token_text=lambda t: f"<{t}>", prompt_logprobs=1, prompt_token_ids=tuple(PROMPT)
)


def test_the_client_sets_prompt_logprobs_and_they_reach_sampling_params() -> None:
    req = build_generate_request("hi", prompt_logprobs=0)
    assert req.HasField("prompt_logprobs") and req.prompt_logprobs == 0
    assert conv.sampling_params(req, stream=False).prompt_logprobs == 0
    assert not build_generate_request("hi").HasField("prompt_logprobs")
    assert conv.sampling_params(build_generate_request("hi"), stream=True).prompt_logprobs is None


def test_out_of_range_prompt_logprobs_is_invalid_argument_naming_it() -> None:
    req = build_generate_request("hi", prompt_logprobs=21)
    with pytest.raises(InvalidRequestError) as err:
        conv.sampling_params(req, stream=False)
    code, details = status_for(err.value, "text")
    assert code is grpc.StatusCode.INVALID_ARGUMENT and details.startswith("prompt_logprobs:")


def test_generate_answers_the_prompt_tokens_after_the_first() -> None:
    out = RequestOutput(
        "r", None, PROMPT, [CompletionOutput(0, "x", [3], "stop")], True, prompt_logprobs=PROMPT_LPS
    )
    resp = conv.final_response(out, CTX)
    assert [(p.token_id, p.token, p.logprob) for p in resp.prompt_logprobs] == [
        (6, "<6>", -0.5),
        (7, "<7>", -1.0),
    ]
    # The top 1 at each position, most likely first.
    assert [t.token_id for t in resp.prompt_logprobs[0].top_logprobs] == [9]
    assert [t.token_id for t in resp.prompt_logprobs[1].top_logprobs] == [7]
    # Not asked: none.
    plain = conv.final_response(out, conv.ResponseContext("r", "m"))
    assert not plain.prompt_logprobs


def test_a_stream_sends_the_prompt_logprobs_once() -> None:
    state = conv.StreamState()
    # A streamed output does not repeat the prompt: the ids come from the context.
    first = RequestOutput(
        "r",
        None,
        [],
        [CompletionOutput(0, delta_text="x", delta_token_ids=[3])],
        prompt_logprobs=PROMPT_LPS,
    )
    last = RequestOutput(
        "r", None, PROMPT, [CompletionOutput(0, "x", [3], "stop")], True, prompt_logprobs=PROMPT_LPS
    )
    one = conv.stream_response(first, state, CTX)
    two = conv.stream_response(last, state, CTX)
    assert one is not None and [p.token_id for p in one.prompt_logprobs] == [6, 7]
    assert two is not None and not two.prompt_logprobs and two.usage.prompt_tokens == 3


def test_a_stream_output_with_only_prompt_logprobs_is_sent() -> None:
    out = RequestOutput("r", None, [], [CompletionOutput(0)], prompt_logprobs=PROMPT_LPS)
    resp = conv.stream_response(out, conv.StreamState(), CTX)
    assert resp is not None and len(resp.prompt_logprobs) == 2 and not resp.completions

"""gRPC request -> engine types mapping, validation, responses and status codes (no server)."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from cluster.errors import (
    AuthenticationError,
    EngineDeadError,
    InvalidRequestError,
    ModelNotFoundError,
    QueueFullError,
)
from cluster.grpc_api import convert as conv
from cluster.grpc_api.client import build_embed_request, build_generate_request
from cluster.grpc_api.servicer import status_for
from cluster.http.protocol import ChatCompletionRequest, CompletionRequest
from cluster.ingress.lora_catalog import LoraCatalog
from kvray.v1 import llm_pb2
from workers.outputs import CompletionOutput, RequestOutput, RequestOutputKind
from workers.pooling import Pooling


def _params(req: llm_pb2.GenerateRequest) -> dict:
    return conv.sampling_kwargs(req, chat=conv.input_kind(req) == "chat")


# -- requests ----------------------------------------------------------------------------------


def test_defaults_match_the_http_api() -> None:
    # Same defaults as /v1/completions (text, token ids) and /v1/chat/completions (chat).
    text = build_generate_request("hi")
    http_text = CompletionRequest(prompt="hi").sampling_params()
    assert conv.sampling_params(text, stream=False) == http_text
    assert _params(text)["max_tokens"] == 16

    chat = build_generate_request(messages=[{"role": "user", "content": "hi"}])
    http_chat = ChatCompletionRequest(
        messages=[{"role": "user", "content": "hi"}]
    ).sampling_params()
    assert conv.sampling_params(chat, stream=False) == http_chat
    assert _params(chat)["max_tokens"] is None


def test_output_kind_follows_the_rpc() -> None:
    # GenerateStream gets deltas; Generate only the final output (nothing per token).
    req = build_generate_request("hi")
    assert conv.sampling_params(req, stream=True).output_kind is RequestOutputKind.DELTA
    assert conv.sampling_params(req, stream=False).output_kind is RequestOutputKind.FINAL_ONLY


def test_every_option_matches_the_http_api() -> None:
    opts = dict(
        n=2,
        max_tokens=7,
        min_tokens=2,
        temperature=0.7,
        top_p=0.9,
        top_k=5,
        min_p=0.05,
        seed=1234,
        stop=["\n", "END"],
        stop_token_ids=[3, 4],
        ignore_eos=True,
        include_stop_str_in_output=True,
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        repetition_penalty=1.1,
        skip_special_tokens=False,
    )
    grpc_req = build_generate_request([5, 6, 7], top_logprobs=3, **opts)
    http_req = CompletionRequest(prompt=[5, 6, 7], logprobs=3, stream=True, **opts)
    assert conv.sampling_params(grpc_req, stream=True) == http_req.sampling_params()


def test_zero_values_are_sent_when_set() -> None:
    # proto3 `optional`: temperature=0 (greedy) must not read as "unset" (1.0).
    p = _params(build_generate_request("x", temperature=0.0, top_k=-1, seed=0))
    assert p["temperature"] == 0.0 and p["top_k"] == -1 and p["seed"] == 0
    assert "top_p" not in p


def test_logprobs_are_off_unless_asked() -> None:
    assert "logprobs" not in _params(build_generate_request("x"))
    assert _params(build_generate_request("x", top_logprobs=0))["logprobs"] == 0


@pytest.mark.parametrize(
    ("request_", "field"),
    [
        (llm_pb2.GenerateRequest(), "input"),
        (llm_pb2.GenerateRequest(text=""), "text"),  # oneof members have presence
        (llm_pb2.GenerateRequest(token_ids=llm_pb2.TokenIds()), "token_ids"),
        (llm_pb2.GenerateRequest(chat=llm_pb2.ChatMessages()), "chat.messages"),
        (
            llm_pb2.GenerateRequest(
                chat=llm_pb2.ChatMessages(messages=[llm_pb2.ChatMessage(role="robot", content="x")])
            ),
            "chat.messages[0].role",
        ),
    ],
)
def test_bad_inputs_name_the_field(request_: llm_pb2.GenerateRequest, field: str) -> None:
    with pytest.raises(InvalidRequestError) as err:
        conv.prompt_input(request_)
    assert err.value.field == field


def test_bad_sampling_values_name_the_field() -> None:
    # The engine's SamplingParams validates (once, for both APIs); the gRPC status names
    # the field where the client wrote it.
    req = build_generate_request("x", top_p=1.5)
    with pytest.raises(InvalidRequestError) as err:
        conv.sampling_params(req, stream=False)
    code, details = status_for(err.value, "text")
    assert code is grpc.StatusCode.INVALID_ARGUMENT
    assert details.startswith("sampling.top_p: ") and "top_p" in details


def test_unknown_model_is_not_found() -> None:
    # The one resolution both ingresses use (cluster/ingress/lora_catalog.py).
    catalog = LoraCatalog("kvray-demo")
    for model in ("", "kvray-demo"):
        assert asyncio.run(catalog.target(model)).lora is None
    with pytest.raises(ModelNotFoundError) as err:
        asyncio.run(catalog.target("gpt-9"))
    assert status_for(err.value)[0] is grpc.StatusCode.NOT_FOUND


def test_field_paths() -> None:
    assert conv.request_field_path("prompt", "token_ids") == "token_ids"
    assert conv.request_field_path("prompt", "chat") == "chat"
    assert conv.request_field_path("messages", "chat") == "chat"
    assert conv.request_field_path("max_tokens", "text") == "sampling.max_tokens"
    assert conv.request_field_path("logprobs", "text") == "logprobs.top_logprobs"
    assert conv.request_field_path(None, "text") is None


# -- status codes -------------------------------------------------------------------------------


def test_status_codes() -> None:
    from ray.exceptions import ActorDiedError
    from ray.serve.exceptions import (
        BackPressureError,
        DeploymentUnavailableError,
        ReplicaUnavailableError,
    )

    from cluster.ray_internals import deployment_id

    cases = [
        (QueueFullError(), grpc.StatusCode.RESOURCE_EXHAUSTED),
        (EngineDeadError(), grpc.StatusCode.UNAVAILABLE),
        (ModelNotFoundError("m"), grpc.StatusCode.NOT_FOUND),
        (AuthenticationError(), grpc.StatusCode.UNAUTHENTICATED),
        (InvalidRequestError("prompt", "prompt too long"), grpc.StatusCode.INVALID_ARGUMENT),
        (
            BackPressureError(num_queued_requests=3, max_queued_requests=2),
            grpc.StatusCode.RESOURCE_EXHAUSTED,
        ),
        (
            DeploymentUnavailableError(deployment_id("LLMServer", "kvray")),
            grpc.StatusCode.UNAVAILABLE,
        ),
        (ReplicaUnavailableError("LLMServer#abc"), grpc.StatusCode.UNAVAILABLE),
        (ActorDiedError(), grpc.StatusCode.UNAVAILABLE),
        (RuntimeError("boom"), grpc.StatusCode.INTERNAL),
    ]
    for exc, code in cases:
        assert status_for(exc, "text")[0] is code, exc


def test_errors_wrapped_by_ray_keep_their_code() -> None:
    from ray.exceptions import RayTaskError

    try:
        raise QueueFullError("full")
    except QueueFullError as err:
        wrapped = RayTaskError("generate", "traceback", err)
    assert status_for(wrapped)[0] is grpc.StatusCode.RESOURCE_EXHAUSTED
    prompt_err = RayTaskError("generate", "tb", InvalidRequestError("prompt", "prompt is too long"))
    code, details = status_for(prompt_err, "token_ids")
    assert code is grpc.StatusCode.INVALID_ARGUMENT and details.startswith("token_ids: ")


# -- responses ----------------------------------------------------------------------------------


def _out(finished: bool, *completions: CompletionOutput, cached: int = 0) -> RequestOutput:
    return RequestOutput(
        request_id="e1",
        prompt=None,
        prompt_token_ids=[1, 2, 3, 4],
        outputs=list(completions),
        finished=finished,
        num_cached_tokens=cached,
    )


CTX = conv.ResponseContext(request_id="client-1", model="kvray-demo")


def test_stream_sends_deltas_finish_once_and_usage_last() -> None:
    state = conv.StreamState()
    a1 = CompletionOutput(0, "ab", [7, 8], delta_text="ab", delta_token_ids=[7, 8])
    b1 = CompletionOutput(1, "", [], delta_text="", delta_token_ids=[])
    m1 = conv.stream_response(_out(False, a1, b1), state, CTX)
    assert m1 is not None and [c.index for c in m1.completions] == [0]
    assert m1.completions[0].text == "ab" and list(m1.completions[0].token_ids) == [7, 8]
    assert not m1.HasField("usage") and m1.request_id == "client-1"

    a2 = CompletionOutput(0, "abc", [7, 8, 9], "length", delta_text="c", delta_token_ids=[9])
    b2 = CompletionOutput(1, "x", [5], delta_text="x", delta_token_ids=[5])
    m2 = conv.stream_response(_out(False, a2, b2), state, CTX)
    assert m2 is not None
    assert [(c.index, c.finish_reason) for c in m2.completions] == [
        (0, llm_pb2.FINISH_REASON_LENGTH),
        (1, llm_pb2.FINISH_REASON_UNSPECIFIED),
    ]

    # Sample 0 already reported its finish: it is not repeated.
    a3 = CompletionOutput(0, "abc", [7, 8, 9], "length")
    b3 = CompletionOutput(1, "x", [5, 2], "stop", stop_reason=2, delta_token_ids=[2])
    m3 = conv.stream_response(_out(True, a3, b3, cached=2), state, CTX)
    assert m3 is not None and [c.index for c in m3.completions] == [1]
    assert m3.completions[0].finish_reason == llm_pb2.FINISH_REASON_STOP
    assert m3.completions[0].stop_token_id == 2
    assert m3.usage == llm_pb2.Usage(
        prompt_tokens=4, completion_tokens=5, total_tokens=9, cached_prompt_tokens=2
    )


def test_stream_skips_outputs_without_news() -> None:
    quiet = CompletionOutput(0, "a", [1])
    assert conv.stream_response(_out(False, quiet), conv.StreamState(), CTX) is None


def test_final_response_is_cumulative() -> None:
    c0 = CompletionOutput(0, "hello", [5, 6], "stop", stop_reason="\n", delta_text="lo")
    resp = conv.final_response(_out(True, c0), CTX)
    (c,) = resp.completions
    assert c.text == "hello" and list(c.token_ids) == [5, 6]
    assert c.finish_reason == llm_pb2.FINISH_REASON_STOP and c.stop_str == "\n"
    assert resp.usage.completion_tokens == 2 and resp.model == "kvray-demo"


def test_logprobs_keep_the_chosen_token_and_the_top_n() -> None:
    # Sampling picked token 9, outside the top 2: the engine sends top-2 plus the chosen one.
    position = {4: -0.1, 5: -0.5, 9: -3.0}
    lp = conv.token_logprob(9, position, 2, token_text=lambda t: f"<{t}>")
    assert lp.token_id == 9 and lp.token == "<9>" and lp.logprob == pytest.approx(-3.0)
    assert [(t.token_id, t.token) for t in lp.top_logprobs] == [(4, "<4>"), (5, "<5>")]
    assert conv.token_logprob(4, position, 0).top_logprobs == []


# -- Embed -------------------------------------------------------------------------------------


def test_embed_inputs_and_options() -> None:
    req = build_embed_request(["a", [1, 2]], pooling_type="mean", truncate_prompt_tokens=8)
    inputs = conv.embed_inputs(req)
    assert [(i.value, i.param, i.label) for i in inputs] == [
        ("a", "inputs[0].text", "inputs[0].text"),
        ([1, 2], "inputs[1].token_ids", "inputs[1].token_ids"),
    ]
    options = conv.embed_options(req)
    assert options.pooling == Pooling("mean", True) and options.truncate_prompt_tokens == 8
    unset = conv.embed_options(build_embed_request("a"))
    assert unset.pooling == Pooling("last", True) and unset.truncate_prompt_tokens is None
    assert conv.embed_options(build_embed_request("a", normalize=False)).pooling.normalize is False


def test_bad_embed_fields_are_named() -> None:
    req = llm_pb2.EmbedRequest(inputs=[llm_pb2.EmbedInput(text="a"), llm_pb2.EmbedInput()])
    with pytest.raises(InvalidRequestError) as err:
        conv.embed_inputs(req)
    assert err.value.field == "inputs[1]"
    with pytest.raises(InvalidRequestError) as err:
        conv.embed_options(llm_pb2.EmbedRequest(pooling_type=7))  # type: ignore[arg-type]
    assert err.value.field == "pooling_type"
    code, details = status_for(InvalidRequestError("inputs[1].text", "inputs[1].text is empty"))
    assert code is grpc.StatusCode.INVALID_ARGUMENT and details.startswith("inputs[1].text: ")


def test_embed_response() -> None:
    stop = CompletionOutput(0, finish_reason="stop")
    finals = [
        RequestOutput("r-0", None, [1, 2], [stop], finished=True, embedding=[0.5, -0.5]),
        RequestOutput("r-1", None, [3], [stop], finished=True, embedding=[1.0, 0.0]),
    ]
    resp = conv.embed_response(finals, "r", "kvray-demo")
    assert (resp.request_id, resp.model) == ("r", "kvray-demo")
    assert [(e.index, list(e.values)) for e in resp.embeddings] == [
        (0, [0.5, -0.5]),
        (1, [1.0, 0.0]),
    ]
    assert (resp.usage.prompt_tokens, resp.usage.total_tokens) == (3, 3)
    assert resp.usage.completion_tokens == 0

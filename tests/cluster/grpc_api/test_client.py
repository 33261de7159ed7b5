"""The Python client's request building (its RPCs run against a real server in test_grpc_*)."""

from __future__ import annotations

import pytest

from cluster.grpc_api.client import (
    build_embed_request,
    build_generate_request,
    build_tokenize_request,
    completion_text,
    embedding_vectors,
)
from kvray.v1 import llm_pb2


def test_text_tokens_and_chat_prompts() -> None:
    assert build_generate_request("hi").WhichOneof("input") == "text"
    assert list(build_generate_request([1, 2]).token_ids.ids) == [1, 2]
    chat = build_generate_request(messages=[{"role": "user", "content": "hi"}])
    assert chat.chat.messages[0] == llm_pb2.ChatMessage(role="user", content="hi")


def test_sampling_options_and_logprobs() -> None:
    req = build_generate_request(
        "hi", model="m", request_id="r", top_logprobs=2, max_tokens=3, temperature=0.0, stop="\n"
    )
    assert req.model == "m" and req.request_id == "r"
    assert req.sampling.HasField("temperature") and req.sampling.temperature == 0.0
    assert list(req.sampling.stop) == ["\n"]
    assert req.logprobs.top_logprobs == 2
    assert not req.sampling.HasField("top_p")  # unset stays unset (server default)


def test_mistakes_are_caught_before_sending() -> None:
    with pytest.raises(TypeError, match="max_token"):
        build_generate_request("hi", max_token=3)
    with pytest.raises(ValueError, match="exactly one"):
        build_generate_request("hi", messages=[{"role": "user", "content": "x"}])
    with pytest.raises(ValueError, match="exactly one"):
        build_generate_request()
    with pytest.raises(ValueError, match="exactly one"):
        build_tokenize_request()


def test_completion_text_picks_by_index() -> None:
    resp = llm_pb2.GenerateResponse(
        completions=[llm_pb2.Completion(index=1, text="b"), llm_pb2.Completion(index=0, text="a")]
    )
    assert completion_text(resp) == "a" and completion_text(resp, 1) == "b"
    assert completion_text(llm_pb2.GenerateResponse()) == ""


def test_embed_requests() -> None:
    one = build_embed_request("hi")
    assert [i.WhichOneof("input") for i in one.inputs] == ["text"]
    assert not one.HasField("normalize") and not one.HasField("truncate_prompt_tokens")
    assert one.pooling_type == llm_pb2.POOLING_TYPE_UNSPECIFIED
    ids = build_embed_request([1, 2])  # one token-id input, not two
    assert [list(i.token_ids.ids) for i in ids.inputs] == [[1, 2]]
    both = build_embed_request(
        ["a", [3]], pooling_type="MEAN", normalize=False, truncate_prompt_tokens=-1, model="m"
    )
    assert [i.WhichOneof("input") for i in both.inputs] == ["text", "token_ids"]
    assert both.pooling_type == llm_pb2.POOLING_TYPE_MEAN and both.model == "m"
    assert both.HasField("normalize") and not both.normalize
    assert both.truncate_prompt_tokens == -1
    with pytest.raises(ValueError, match="pooling_type"):
        build_embed_request("hi", pooling_type="cls")


def test_embedding_vectors_in_input_order() -> None:
    resp = llm_pb2.EmbedResponse(
        embeddings=[
            llm_pb2.Embedding(index=1, values=[2.0]),
            llm_pb2.Embedding(index=0, values=[1.0]),
        ]
    )
    assert embedding_vectors(resp) == [[1.0], [2.0]]

"""POST /v1/embeddings' body and answer (cluster/http/embeddings.py), without Ray: what the
body accepts, how each input is named, base64 as the openai client decodes it, and the
response's shape from hand-built engine outputs."""

from __future__ import annotations

import array
import base64
import struct
from typing import Any

import numpy as np
import pytest
from pydantic import ValidationError

from cluster.errors import InvalidRequestError
from cluster.http.embeddings import EmbeddingFormatter, EmbeddingRequest, encode_base64
from workers.outputs import CompletionOutput, RequestOutput
from workers.pooling import Pooling

VECTORS = [[0.1, -2.5, 3.0e-3, 1.0e6], [0.0, 1.0, -1.0, 0.333]]


def _out(i: int, vector: list[float], prompt: list[int]) -> RequestOutput:
    return RequestOutput(
        f"embd-x-{i}",
        None,
        prompt,
        [CompletionOutput(0, finish_reason="stop")],
        finished=True,
        embedding=vector,
    )


FINALS = [_out(0, VECTORS[0], [1, 2, 3]), _out(1, VECTORS[1], [4, 5])]


@pytest.mark.parametrize(
    ("value", "labels"),
    [
        ("hello", ["input"]),
        (["a", "b"], ["input[0]", "input[1]"]),
        ([1, 2, 3], ["input"]),
        ([[1, 2], [3]], ["input[0]", "input[1]"]),
        ([], []),
    ],
)
def test_input_shapes(value: Any, labels: list[str]) -> None:
    inputs = EmbeddingRequest(input=value).inputs()
    assert [i.label for i in inputs] == labels
    assert all(i.param == "input" for i in inputs)
    if labels and isinstance(value, list) and isinstance(value[0], int):
        assert inputs[0].value == value  # one token-id input, not three


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"input": ["a", [1]]}, "input"),
        ({"input": [1.5]}, "input"),
        ({}, "input"),
        ({"input": "a", "encoding_format": "int8"}, "encoding_format"),
        ({"input": "a", "dimensions": "8"}, "dimensions"),
        ({"input": "a", "normalize": 1}, "normalize"),
        ({"input": "a", "truncate_prompt_tokens": 2.0}, "truncate_prompt_tokens"),
    ],
)
def test_bad_bodies_fail_validation_at_the_field(body: dict[str, Any], field: str) -> None:
    with pytest.raises(ValidationError) as err:
        EmbeddingRequest(**body)
    assert err.value.errors()[0]["loc"][0] == field


def test_options_and_unknown_fields() -> None:
    body = EmbeddingRequest(
        input="a", user="u-1", normalize=False, pooling_type="mean", truncate_prompt_tokens=-1,
        add_special_tokens=True,  # a vLLM field kvray ignores, like any unknown field
    )  # fmt: skip
    options = body.options()
    assert options.pooling == Pooling("mean", False)
    assert options.truncate_prompt_tokens == -1
    assert EmbeddingRequest(input="a").options().pooling == Pooling("last", True)
    with pytest.raises(InvalidRequestError) as err:
        EmbeddingRequest(input="a", pooling_type="cls").options()
    assert err.value.field == "pooling_type"


def test_base64_is_little_endian_float32_as_the_openai_client_decodes_it() -> None:
    vector = VECTORS[0]
    raw = base64.b64decode(encode_base64(vector))
    expected = [float(np.float32(v)) for v in vector]
    assert list(struct.unpack(f"<{len(vector)}f", raw)) == expected
    # The openai client's two decoders: numpy when installed, else the array module.
    assert np.frombuffer(raw, dtype="float32").tolist() == expected
    assert array.array("f", raw).tolist() == expected


def test_float_response_shape() -> None:
    resp = EmbeddingFormatter("embd-x", "kvray-demo").response(FINALS)
    assert resp["object"] == "list" and resp["model"] == "kvray-demo" and resp["id"] == "embd-x"
    assert resp["data"] == [
        {"object": "embedding", "index": 0, "embedding": VECTORS[0]},
        {"object": "embedding", "index": 1, "embedding": VECTORS[1]},
    ]
    assert resp["usage"] == {"prompt_tokens": 5, "total_tokens": 5}


def test_base64_response_parses_with_the_openai_client() -> None:
    from openai import NOT_GIVEN
    from openai.lib._parsing._embeddings import parse_embedding_response
    from openai.types import CreateEmbeddingResponse

    resp = EmbeddingFormatter("embd-x", "kvray-demo", "base64").response(FINALS)
    assert all(isinstance(d["embedding"], str) for d in resp["data"])
    # What `client.embeddings.create(...)` does when encoding_format is left to it: build the
    # response without validation, then decode.
    parsed = parse_embedding_response(
        CreateEmbeddingResponse.construct(**resp), encoding_format=NOT_GIVEN
    )
    for got, want in zip(parsed.data, VECTORS, strict=True):
        assert got.embedding == pytest.approx(want, rel=1e-6)
    assert parsed.usage.prompt_tokens == 5


def test_dimensions_are_checked_against_the_vectors() -> None:
    EmbeddingFormatter("embd-x", "m", dimensions=4).response(FINALS)
    with pytest.raises(InvalidRequestError) as err:
        EmbeddingFormatter("embd-x", "m", dimensions=3).response(FINALS)
    assert err.value.field == "dimensions" and "(4)" in err.value.message

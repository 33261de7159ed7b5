"""kvray.v1.LLMService/Embed end to end, on the shared app's gRPC ingress (tests/cluster/
conftest.py's `kvray_app`, which listens on Serve's gRPC port as `kvray serve` does): the same
vectors as POST /v1/embeddings, errors naming the field where the client set it."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import numpy as np
import pytest

from cluster.grpc_api.client import KvrayClient, embedding_vectors
from kvray.v1 import llm_pb2, llm_pb2_grpc
from tests.cluster.grpc_api.grpc_helpers import rpc_status, wait_serving
from tests.cluster.serve_helpers import API_KEY, App, ServePorts, openai_client

pytestmark = pytest.mark.slow

TEXTS = ["The river runs to the sea.", "Once upon a time"]


@pytest.fixture(scope="module")
def target(kvray_app: App, serve_ports: ServePorts) -> str:
    wait_serving(serve_ports.grpc)
    return f"127.0.0.1:{serve_ports.grpc}"


@pytest.fixture(scope="module")
def embed_client(target: str, kvray_app: App) -> Iterator[KvrayClient]:
    with KvrayClient(target, kvray_app.api_key, timeout=120) as c:
        yield c


def test_embed_equals_the_http_api(embed_client: KvrayClient, kvray_app: App) -> None:
    http = openai_client(kvray_app).embeddings.create(
        model=kvray_app.model, input=TEXTS, encoding_format="float"
    )
    resp = embed_client.embed(TEXTS, request_id="mine")
    assert resp.request_id == "mine" and resp.model == kvray_app.model
    assert [e.index for e in resp.embeddings] == [0, 1]
    for got, want in zip(embedding_vectors(resp), http.data, strict=True):
        assert np.abs(np.asarray(got) - np.asarray(want.embedding)).max() < 1e-6
    assert resp.usage.prompt_tokens == resp.usage.total_tokens == http.usage.prompt_tokens
    assert resp.usage.completion_tokens == 0

    # Token ids and options: mean pooling, not normalised, as over HTTP.
    ids = embed_client.tokenize(TEXTS[1])
    mean = embed_client.embed([ids], pooling_type="mean", normalize=False)
    http_mean = openai_client(kvray_app).embeddings.create(
        model=kvray_app.model,
        input=ids,
        encoding_format="float",
        extra_body={"pooling_type": "mean", "normalize": False},
    )
    (vector,) = embedding_vectors(mean)
    assert np.abs(np.asarray(vector) - np.asarray(http_mean.data[0].embedding)).max() < 1e-6
    assert abs(np.linalg.norm(vector) - 1.0) > 1e-3  # really not normalised


def test_invalid_embed_requests_name_the_field(embed_client: KvrayClient, target: str) -> None:
    (model,) = embed_client.list_models()
    too_long = [1] * (model.max_model_len + 1)
    cases = [
        (lambda: embed_client.embed([]), "inputs"),
        (lambda: embed_client.embed(["a", ""]), "inputs[1].text"),
        (lambda: embed_client.embed(["a", too_long]), "inputs[1].token_ids"),
        (lambda: embed_client.embed("a", truncate_prompt_tokens=0), "truncate_prompt_tokens"),
    ]
    for call, field in cases:
        code, details = rpc_status(call)
        assert code is grpc.StatusCode.INVALID_ARGUMENT, details
        assert details.startswith(f"{field}: "), details
    # An enum value this server does not know (the client refuses unknown names: raw stub).
    bad = llm_pb2.EmbedRequest(inputs=[llm_pb2.EmbedInput(text="a")], pooling_type=9)  # type: ignore[arg-type]
    with grpc.insecure_channel(target) as channel:
        stub = llm_pb2_grpc.LLMServiceStub(channel)
        auth = (("authorization", f"Bearer {API_KEY}"),)
        code, details = rpc_status(lambda: stub.Embed(bad, metadata=auth, timeout=60))
    assert code is grpc.StatusCode.INVALID_ARGUMENT and details.startswith("pooling_type: ")
    # Truncation makes the long input fit.
    cut = embed_client.embed([too_long], truncate_prompt_tokens=-1)
    assert cut.usage.prompt_tokens == model.max_model_len
    code, _ = rpc_status(lambda: embed_client.embed("a", model="other-model"))
    assert code is grpc.StatusCode.NOT_FOUND


def test_embed_needs_the_api_key(target: str) -> None:
    for key in (None, "wrong"):
        with KvrayClient(target, key, timeout=60) as c:
            code, _ = rpc_status(lambda c=c: c.embed("a"))
            assert code is grpc.StatusCode.UNAUTHENTICATED

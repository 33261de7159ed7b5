"""POST /v1/embeddings end to end: the shared app (2 replicas, API key), the official openai
client, and transformers' `last_hidden_state` of the demo checkpoint as the oracle."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest

from cluster.ingress.limits import DEFAULT_LIMITS
from tests.cluster.serve_helpers import App, RaySession, openai_client, wait_until_idle
from tests.monitoring.promkit import scrape, wait_for

pytestmark = pytest.mark.slow

TEXTS = ["The river runs to the sea.", "Once upon a time", "def fibonacci(n):"]
TOLERANCE = 1e-4
EXPORT_S = 2.5  # over two of Ray's metrics report intervals (1 s in the test session)


@pytest.fixture(scope="module")
def client(kvray_app: App) -> openai.OpenAI:
    return openai_client(kvray_app)


@pytest.fixture(scope="module")
def hf(demo_dir: Path) -> Any:
    """transformers' base model (no LM head) and tokenizer of the demo checkpoint, float32."""
    import torch
    from transformers import AutoModel, AutoTokenizer

    model = AutoModel.from_pretrained(demo_dir, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(demo_dir)


def _reference(hf: Any, ids: list[int], pooling: str = "last", normalize: bool = True) -> Any:
    import torch

    model, _ = hf
    with torch.inference_mode():
        states = model(torch.tensor([ids])).last_hidden_state[0]
    vector = states[-1] if pooling == "last" else states.mean(dim=0)
    if normalize:
        vector = vector / vector.norm()
    return vector.numpy()


def _close(got: list[float], want: Any) -> None:
    assert len(got) == len(want)
    assert np.abs(np.asarray(got) - want).max() < TOLERANCE


def test_embeddings_equal_transformers_pooled_hidden_state(
    client: openai.OpenAI, hf: Any, kvray_app: App
) -> None:
    # The client's default: it asks for base64 and decodes it with numpy.
    resp = client.embeddings.create(model=kvray_app.model, input=TEXTS)
    assert [d.index for d in resp.data] == [0, 1, 2] and resp.model == kvray_app.model
    ids = [hf[1].encode(t) for t in TEXTS]
    for d, one in zip(resp.data, ids, strict=True):
        assert isinstance(d.embedding, list)
        _close(d.embedding, _reference(hf, one))
        assert abs(np.linalg.norm(d.embedding) - 1.0) < TOLERANCE
    total = sum(len(x) for x in ids)
    assert (resp.usage.prompt_tokens, resp.usage.total_tokens) == (total, total)

    # Floats as JSON give the same vectors.
    floats = client.embeddings.create(
        model=kvray_app.model, input=TEXTS[0], encoding_format="float"
    )
    _close(floats.data[0].embedding, np.asarray(resp.data[0].embedding))


def test_base64_without_numpy_and_token_id_inputs(
    client: openai.OpenAI, hf: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from openai.lib._parsing import _embeddings

    # A client without numpy decodes base64 with the array module.
    monkeypatch.setattr(_embeddings, "has_numpy", lambda: False)
    ids = hf[1].encode(TEXTS[1])
    one = client.embeddings.create(model="kvray-demo", input=ids)
    several = client.embeddings.create(model="kvray-demo", input=[ids, ids[:3]])
    _close(one.data[0].embedding, _reference(hf, ids))
    _close(several.data[0].embedding, _reference(hf, ids))
    _close(several.data[1].embedding, _reference(hf, ids[:3]))


def test_mean_pooling_unnormalised_and_dimensions(
    client: openai.OpenAI, hf: Any, kvray_app: App
) -> None:
    ids = hf[1].encode(TEXTS[2])
    size = hf[0].config.hidden_size
    resp = client.embeddings.create(
        model=kvray_app.model,
        input=TEXTS[2],
        dimensions=size,  # the model's own size is accepted
        extra_body={"pooling_type": "mean", "normalize": False},
    )
    _close(resp.data[0].embedding, _reference(hf, ids, "mean", normalize=False))


def _error(client: openai.OpenAI, **kw: Any) -> openai.BadRequestError:
    with pytest.raises(openai.BadRequestError) as err:
        client.embeddings.create(model="kvray-demo", **kw)
    return err.value


def test_bad_requests_are_400_naming_the_field(client: openai.OpenAI, kvray_app: App) -> None:
    err = _error(client, input="hello", dimensions=8)
    assert err.body["param"] == "dimensions" and "cannot" in err.body["message"]

    max_model_len = client.models.list().data[0].model_extra["max_model_len"]
    err = _error(client, input=[[1] * (max_model_len + 1)])
    assert err.body["param"] == "input" and str(max_model_len) in err.body["message"]
    # ... unless the client asks to keep the last tokens.
    cut = client.embeddings.create(
        model="kvray-demo",
        input=[[1] * (max_model_len + 1)],
        extra_body={"truncate_prompt_tokens": 4},
    )
    assert cut.usage.prompt_tokens == 4

    assert _error(client, input="").body["param"] == "input"
    assert _error(client, input=[]).body["param"] == "input"
    assert _error(client, input=["a", ""]).body["param"] == "input"
    err = _error(client, input=["a"] * (DEFAULT_LIMITS.max_prompts_per_request + 1))
    assert err.body["param"] == "input" and "max_prompts_per_request" in err.body["message"]
    assert _error(client, input="a", extra_body={"pooling_type": "cls"}).body["param"] == (
        "pooling_type"
    )
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="other-model", input="a")
    # Nothing was left running or holding KV blocks by the refused requests.
    wait_until_idle(kvray_app, 2)


def test_the_api_key_is_required(kvray_app: App) -> None:
    with pytest.raises(openai.AuthenticationError):
        openai_client(kvray_app, api_key="wrong").embeddings.create(model="kvray-demo", input="a")
    r = httpx.post(f"{kvray_app.base_url}/v1/embeddings", json={"input": "a"}, timeout=60)
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"


def test_embedding_requests_are_counted_by_kind(
    client: openai.OpenAI, ray_session: RaySession
) -> None:
    def count() -> float:
        found = scrape(ray_session.metrics_url).value(
            "ray_kvray_router_requests_by_kind_total", protocol="http", kind="embedding"
        )
        return found or 0.0

    def two_counts() -> tuple[float, float]:
        first = count()
        time.sleep(EXPORT_S)
        return first, count()

    # The earlier tests' requests reach the exporter within a few report intervals: start
    # from a count that no longer moves.
    _, before = wait_for(two_counts, lambda pair: pair[0] == pair[1], "a settled count")
    client.embeddings.create(model="kvray-demo", input=["one request", "of two inputs"])
    _error(client, input="")  # refused before routing: not counted
    wait_for(count, lambda n: n == before + 1, "one embedding request counted")

"""Request bounds and error bodies of the HTTP API end to end: the shared app (default
bounds, an API key), the official client and raw httpx. Every refusal is a 4xx in OpenAI's
error format naming the field and the limit; none reaches an engine replica."""

from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest

from cluster.ingress.limits import DEFAULT_LIMITS
from tests.cluster.serve_helpers import App, openai_client

pytestmark = pytest.mark.slow

MiB = 1024 * 1024


@pytest.fixture(scope="module")
def client(kvray_app: App) -> openai.OpenAI:
    return openai_client(kvray_app)


@pytest.fixture(scope="module")
def http(kvray_app: App) -> Any:
    with httpx.Client(base_url=kvray_app.base_url, timeout=120) as c:
        yield c


def _auth(app: App) -> dict[str, str]:
    return {"Authorization": f"Bearer {app.api_key}"}


def _error(resp: httpx.Response, status: int) -> dict[str, Any]:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == status
    return err


def _bad_request(call: Any, param: str, setting: str) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        call()
    body = err.value.body
    assert body["param"] == param and setting in body["message"], body


def test_n_over_the_limit(client: openai.OpenAI, kvray_app: App) -> None:
    n = DEFAULT_LIMITS.max_n + 1
    _bad_request(
        lambda: client.completions.create(model=kvray_app.model, prompt="hi", n=n, max_tokens=1),
        "n",
        "max_n",
    )


def test_stop_lists_over_the_limits(client: openai.OpenAI, kvray_app: App) -> None:
    many = [f"s{i}" for i in range(DEFAULT_LIMITS.max_stop_strings + 1)]
    _bad_request(
        lambda: client.completions.create(
            model=kvray_app.model, prompt="hi", max_tokens=1, stop=many
        ),
        "stop",
        "max_stop_strings",
    )
    long = "x" * (DEFAULT_LIMITS.max_stop_string_chars + 1)
    _bad_request(
        lambda: client.chat.completions.create(
            model=kvray_app.model, messages=[{"role": "user", "content": "hi"}], stop=[long]
        ),
        "stop",
        "max_stop_string_chars",
    )
    ids = list(range(DEFAULT_LIMITS.max_stop_token_ids + 1))
    _bad_request(
        lambda: client.completions.create(
            model=kvray_app.model, prompt="hi", max_tokens=1, extra_body={"stop_token_ids": ids}
        ),
        "stop_token_ids",
        "max_stop_token_ids",
    )


def test_prompt_and_message_counts(client: openai.OpenAI, kvray_app: App) -> None:
    prompts = ["hi"] * (DEFAULT_LIMITS.max_prompts_per_request + 1)
    _bad_request(
        lambda: client.completions.create(model=kvray_app.model, prompt=prompts, max_tokens=1),
        "prompt",
        "max_prompts_per_request",
    )
    messages = [{"role": "user", "content": "hi"}] * (DEFAULT_LIMITS.max_chat_messages + 1)
    _bad_request(
        lambda: client.chat.completions.create(model=kvray_app.model, messages=messages),
        "messages",
        "max_chat_messages",
    )


@pytest.mark.parametrize("value", ["Infinity", "-Infinity", "NaN"])
@pytest.mark.parametrize("field", ["temperature", "repetition_penalty", "top_p"])
def test_non_finite_floats(http: httpx.Client, kvray_app: App, field: str, value: str) -> None:
    # JSON has no Infinity/NaN, but Python's parser (and many clients) accept the literals.
    body = f'{{"prompt": "hi", "max_tokens": 1, "{field}": {value}}}'
    resp = http.post(
        "/v1/completions",
        content=body,
        headers={**_auth(kvray_app), "Content-Type": "application/json"},
    )
    assert _error(resp, 400)["param"] == field


def test_a_body_over_the_limit_is_413_and_401_without_a_key(
    http: httpx.Client, kvray_app: App
) -> None:
    big = b'{"prompt": "' + b"x" * (9 * MiB) + b'"}'
    headers = {"Content-Type": "application/json"}
    err = _error(
        http.post("/v1/completions", content=big, headers={**headers, **_auth(kvray_app)}), 413
    )
    assert "max_request_body_bytes" in err["message"]
    # Without the key the body is refused unread: 401, not 413.
    assert _error(http.post("/v1/completions", content=big, headers=headers), 401)["type"] == (
        "authentication_error"
    )


def test_framework_errors_are_openai_errors(http: httpx.Client, kvray_app: App) -> None:
    auth = _auth(kvray_app)
    assert _error(http.get("/v1/no-such-route", headers=auth), 404)["type"] == "not_found_error"
    _error(http.get("/v1/completions", headers=auth), 405)
    bad_json = http.post(
        "/v1/completions",
        content=b'{"prompt": "hi",',
        headers={**auth, "Content-Type": "application/json"},
    )
    assert "JSON" in _error(bad_json, 400)["message"]
    not_an_object = http.post("/v1/completions", json=[1, 2], headers=auth)
    _error(not_an_object, 400)
    wrong_type = http.post("/v1/completions", json={"prompt": "hi", "n": "many"}, headers=auth)
    assert _error(wrong_type, 400)["param"] == "n"


def test_docs_are_behind_the_key(http: httpx.Client, kvray_app: App) -> None:
    for path in ("/docs", "/redoc", "/openapi.json"):
        _error(http.get(path), 401)
        assert http.get(path, headers=_auth(kvray_app)).status_code == 200
    assert http.get("/health").status_code == 200


def test_in_bounds_requests_still_serve(client: openai.OpenAI, kvray_app: App) -> None:
    out = client.completions.create(
        model=kvray_app.model,
        prompt=["a", "b"],
        n=2,
        max_tokens=2,
        stop=["x" * DEFAULT_LIMITS.max_stop_string_chars],
    )
    assert len(out.choices) == 4


@pytest.mark.parametrize("field", ["top_p", "min_p", "temperature", "repetition_penalty"])
def test_denormal_floats_still_serve(client: openai.OpenAI, kvray_app: App, field: str) -> None:
    # Found by test_fuzz: 5e-324 is 0.0 in the engine's float32 tensors; top_p = 0 made the
    # top-p filter keep no token, and the step failed with an IndexError.
    out = client.completions.create(
        model=kvray_app.model, prompt="hi", max_tokens=2, extra_body={field: 5e-324}
    )
    assert out.choices[0].finish_reason in ("stop", "length")

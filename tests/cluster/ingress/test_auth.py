"""API keys: the checker itself, and 401s over real HTTP (open /health and /ready)."""

from __future__ import annotations

import httpx
import openai
import pytest

from cluster.errors import AuthenticationError
from cluster.ingress.auth import ApiKeyAuth, with_api_key
from tests.cluster.serve_helpers import App, openai_client


def test_checker() -> None:
    auth = ApiKeyAuth.from_env("K", {"K": "s3cret"})
    assert auth.enabled
    auth.check("Bearer s3cret")
    auth.check("bearer s3cret")
    for bad in (None, "", "s3cret", "Bearer wrong", "Basic s3cret", "Bearer s3cret2"):
        with pytest.raises(AuthenticationError):
            auth.check(bad)
    auth.check_path("/health", None)
    auth.check_path("/ready", None)
    with pytest.raises(AuthenticationError):
        auth.check_path("/tokenize", None)


def test_x_api_key_is_read_as_the_bearer_token() -> None:
    assert with_api_key({"x-api-key": " k "}) == {"x-api-key": " k ", "authorization": "Bearer k"}
    both = {"x-api-key": "k", "authorization": "Bearer other"}
    assert with_api_key(both) == both  # an Authorization header wins
    assert with_api_key({"host": "h"}) == {"host": "h"}


def test_no_key_means_auth_off() -> None:
    for auth in (ApiKeyAuth.from_env("K", {}), ApiKeyAuth.from_env("K", {"K": ""})):
        assert not auth.enabled
        auth.check(None)


@pytest.mark.slow
def test_http_401_without_or_with_a_wrong_key(kvray_app: App) -> None:
    for key in (None, "wrong-key"):
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        for method, path, body in (
            ("POST", "/v1/completions", {"prompt": "hi", "max_tokens": 2}),
            ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}),
            ("GET", "/v1/models", None),
            ("POST", "/tokenize", {"prompt": "hi"}),
            ("POST", "/detokenize", {"tokens": [1]}),
        ):
            r = httpx.request(method, f"{kvray_app.base_url}{path}", json=body, headers=headers)
            assert r.status_code == 401, (key, path, r.text)
            assert r.json()["error"]["type"] == "authentication_error"
    with pytest.raises(openai.AuthenticationError):
        openai_client(kvray_app, api_key="wrong-key").models.list()
    for path in ("/health", "/ready"):
        assert httpx.get(f"{kvray_app.base_url}{path}").status_code == 200

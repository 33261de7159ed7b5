"""The OpenAI API fuzzed from its own OpenAPI schema (schemathesis) against the shared app.

The schema is the one the server serves (/openapi.json, behind the API key), so a route
whose body is not documented there is not fuzzed, and the test says so. Every operation
gets schema-valid and schema-invalid requests; whatever they hold, the answer is never a
5xx, comes within RESPONSE_TIMEOUT_S (a hang fails the test), and every 4xx is OpenAI's error
body `{"error": {"message", "type", "param", "code"}}`. Requests without the API key, or with
a wrong one, are a 401 in that format on every route but the probes.

Generation stays cheap: max_tokens and n of each fuzzed body are capped before it is sent
(values over the server's limits are kept: they are cheap 400s). The examples are
derandomized, so a run is the same on every machine.
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    negative_data_rejection,
    response_schema_conformance,
    status_code_conformance,
)

from cluster.ingress.limits import DEFAULT_LIMITS
from tests.cluster.serve_helpers import App

pytestmark = pytest.mark.slow

RESPONSE_TIMEOUT_S = 60.0  # a liveness bound (a hang), far above any answer's real time
MAX_TOKENS = 3  # generation is capped to this many tokens per completion
MAX_N = 2  # and to this many completions (n over the server's max_n is kept: a cheap 400)
PROBES = frozenset({"/health", "/ready"})  # open without the key (liveness / readiness)
FUZZ = settings(
    max_examples=25,
    derandomize=True,
    database=None,
    deadline=None,
    suppress_health_check=list(HealthCheck),
    # The first failing request is reported as it was sent: shrinking it would replay
    # hundreds of requests against the server.
    phases=(Phase.explicit, Phase.generate),
)
CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
    negative_data_rejection,
]


# Every operation of the schema (the test checks the list is complete), with the number of
# examples per generation mode: the generation routes get the most.
OPERATIONS = {
    ("GET", "/health"): 2,
    ("GET", "/ready"): 2,
    ("GET", "/v1/models"): 2,
    # Most random completion bodies are refused (suffix, best_of != n, an empty
    # prompt, ids past the vocabulary...): enough examples that some reach the engine.
    ("POST", "/v1/completions"): 100,
    ("POST", "/v1/chat/completions"): 50,
    ("POST", "/v1/responses"): 50,
    ("POST", "/v1/embeddings"): 30,
    ("POST", "/tokenize"): 30,
    ("POST", "/detokenize"): 30,
}
# Documented but not fuzzed here: Anthropic's Messages routes answer in Anthropic's error
# shape, and their bodies (content blocks) are checked field by field by
# tests/cluster/http/test_messages*.py, end to end with the `anthropic` client.
NOT_FUZZED = {("POST", "/v1/messages"), ("POST", "/v1/messages/count_tokens")}


@pytest.fixture(scope="module")
def api_schema(kvray_app: App) -> Any:
    # The live server's own document (its routes' pydantic bodies, as FastAPI renders them).
    url = f"{kvray_app.base_url}/openapi.json"
    raw = httpx.get(url, headers=_auth(kvray_app.api_key), timeout=RESPONSE_TIMEOUT_S)
    raw.raise_for_status()
    return schemathesis.openapi.from_dict(raw.json())


def test_schema_documents_every_route_and_body(api_schema: Any) -> None:
    ops = {
        (op.method.upper(), op.path): op for op in (r.ok() for r in api_schema.get_all_operations())
    }
    assert set(ops) == set(OPERATIONS) | NOT_FUZZED
    for (method, path), op in ops.items():
        if method == "POST":  # a route reading raw JSON would leave its body out of the schema
            assert op.definition.raw["requestBody"]["content"]["application/json"], path
        assert "4XX" in op.definition.raw["responses"], path  # not FastAPI's 422


def _auth(key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"} if key else {}


# The fields bounding a body's generation, by route (/v1/responses refuses the others).
TOKEN_FIELDS = {"/v1/responses": ("max_output_tokens",)}


def cap_cost(body: Any, path: str = "") -> None:
    """Caps the generation a body asks for, in place; values of other types are left for the
    server to refuse."""
    if not isinstance(body, dict):
        return
    for field in TOKEN_FIELDS.get(path, ("max_tokens", "max_completion_tokens")):
        value = body.get(field)
        if field not in body or (_is_int(value) and value > MAX_TOKENS):
            body[field] = MAX_TOKENS  # chat's default is the whole context: never leave it
    n = body.get("n")
    if _is_int(n) and MAX_N < n <= DEFAULT_LIMITS.max_n:
        body["n"] = MAX_N
    best_of = body.get("best_of")
    if _is_int(best_of) and MAX_N < best_of <= DEFAULT_LIMITS.max_n:
        body["best_of"] = MAX_N


def _content_type(response: Any) -> str:
    values = response.headers.get("content-type") or [""]  # schemathesis keeps every value
    return values[0] if isinstance(values, list) else values


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_openai_error(response: Any, *, auth: bool = False) -> None:
    """A 4xx/5xx body is OpenAI's error format, its `code` the status."""
    if response.status_code < 400:
        return
    assert _content_type(response).startswith("application/json"), (
        response.status_code,
        response.text[:500],
    )
    body = response.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"], err
    assert err["code"] == response.status_code, err
    if auth:
        assert err["type"] == "authentication_error", err


@pytest.mark.parametrize(
    ("method", "path", "mode"),
    [(m, p, GenerationMode.POSITIVE) for m, p in OPERATIONS]
    # Operations without parameters or body have no invalid request to generate.
    + [(m, p, GenerationMode.NEGATIVE) for m, p in OPERATIONS if m == "POST"],
)
def test_fuzzed_requests(
    api_schema: Any, kvray_app: App, method: str, path: str, mode: GenerationMode
) -> None:
    operation = api_schema[path][method]
    statuses: list[tuple[int, str]] = []  # status, and the error's message

    @settings(FUZZ, max_examples=OPERATIONS[(method, path)])
    @given(case=operation.as_strategy(generation_mode=mode))
    def fuzz(case: Any) -> None:
        cap_cost(case.body, path)
        response = case.call(
            base_url=kvray_app.base_url,
            headers=_auth(kvray_app.api_key),
            timeout=RESPONSE_TIMEOUT_S,
        )
        statuses.append(
            (response.status_code, response.text[:80] if response.status_code >= 400 else "")
        )
        assert response.status_code < 500, response.text[:500]
        check_openai_error(response)
        case.validate_response(response, checks=CHECKS)

    fuzz()
    if mode is GenerationMode.POSITIVE:
        # Valid requests got through the checks to an engine too, not only to refusals.
        assert any(status == 200 for status, _ in statuses), statuses


@pytest.mark.parametrize(("method", "path"), list(OPERATIONS))
def test_fuzzed_requests_without_the_key(
    api_schema: Any, kvray_app: App, method: str, path: str
) -> None:
    operation = api_schema[path][method]

    @settings(FUZZ, max_examples=3)
    @given(case=operation.as_strategy(generation_mode=GenerationMode.POSITIVE))
    def fuzz(case: Any) -> None:
        cap_cost(case.body, path)
        for key in (None, "wrong-key"):
            response = case.call(
                base_url=kvray_app.base_url, headers=_auth(key), timeout=RESPONSE_TIMEOUT_S
            )
            if path in PROBES:
                assert response.status_code < 500, response.text[:500]
                continue
            assert response.status_code == 401, (path, key, response.text[:500])
            check_openai_error(response, auth=True)

    fuzz()

"""kvray's errors in Anthropic's shape and status codes on the Messages routes, checked
against the `anthropic` client's own error models."""

from __future__ import annotations

import pytest
from anthropic.types import ErrorResponse

from cluster.errors import (
    AuthenticationError,
    DrainingError,
    EngineDeadError,
    InvalidRequestError,
    KvrayError,
    ModelNotFoundError,
    QueueFullError,
    QueueTimeoutError,
    RequestTimeoutError,
)
from cluster.http.guard import RequestTooLargeError
from cluster.http.messages_errors import from_error, from_status, is_messages_path


@pytest.mark.parametrize(
    ("err", "status", "kind"),
    [
        (InvalidRequestError("max_tokens", "max_tokens: required"), 400, "invalid_request_error"),
        (AuthenticationError(), 401, "authentication_error"),
        (ModelNotFoundError("claude"), 404, "not_found_error"),
        (RequestTooLargeError(10), 413, "request_too_large"),
        (QueueFullError(), 429, "rate_limit_error"),
        (QueueTimeoutError(), 529, "overloaded_error"),
        (DrainingError(), 529, "overloaded_error"),
        (EngineDeadError(), 529, "overloaded_error"),
        (RequestTimeoutError(), 504, "timeout_error"),
        (KvrayError("boom"), 500, "api_error"),
    ],
)
def test_each_error_class_maps_to_anthropics(err: KvrayError, status: int, kind: str) -> None:
    got_status, body = from_error(err)
    assert (got_status, body["error"]["type"]) == (status, kind)
    if kind != "request_too_large":  # the SDK's union lacks it; Anthropic's API sends it
        ErrorResponse.model_validate(body)


def test_a_field_error_names_the_field_first() -> None:
    _, body = from_error(InvalidRequestError("top_k", "must be -1 or at least 1"))
    assert body == {
        "type": "error",
        "error": {"type": "invalid_request_error", "message": "top_k: must be -1 or at least 1"},
    }
    _, same = from_error(InvalidRequestError("top_k", "top_k must be -1 or at least 1"))
    assert same["error"]["message"] == "top_k must be -1 or at least 1"


def test_http_errors_and_paths() -> None:
    assert from_status(405, "Method Not Allowed")[0] == 405
    assert from_status(404, "Not Found")[1]["error"]["type"] == "not_found_error"
    assert is_messages_path("/v1/messages") and is_messages_path("/v1/messages/count_tokens")
    assert not is_messages_path("/v1/messagesx") and not is_messages_path("/v1/chat/completions")

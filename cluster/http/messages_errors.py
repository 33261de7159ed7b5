"""Errors on Anthropic's Messages routes (/v1/messages, /v1/messages/count_tokens), in
Anthropic's shape: `{"type": "error", "error": {"type": ..., "message": ...}}`.

Every kvray error class keeps its meaning; only the body and, where Anthropic's API uses
another code for the same case, the status change. The mapping goes by the class's HTTP
status, which already sorts kvray's errors by what the client should do:

    400 (InvalidRequestError, LoRA adapter errors)        400 invalid_request_error
    401 (AuthenticationError)                             401 authentication_error
    403                                                   403 permission_error
    404 (ModelNotFoundError, unknown adapter or route)    404 not_found_error
    413 (the body over max_request_body_bytes)            413 request_too_large
    429 (QueueFullError, QuotaExceededError)              429 rate_limit_error
    503 (QueueTimeoutError, DrainingError, EngineDeadError
         after migration, LoRA registry unavailable)      529 overloaded_error
    504 (RequestTimeoutError)                             504 timeout_error
    any other 5xx (an internal error)                     500 api_error

kvray's 503s all mean "no capacity to take this now; retry later or elsewhere": Anthropic's
API says that with 529 `overloaded_error`, which its SDKs retry. Retry-After stays as the
class sets it.
"""

from __future__ import annotations

from typing import Any

from cluster.errors import KvrayError

# Where the routes are, below the app's route prefix.
MESSAGES_PATH = "/v1/messages"

# kvray's HTTP status -> (Anthropic's status, Anthropic's error type).
BY_STATUS: dict[int, tuple[int, str]] = {
    400: (400, "invalid_request_error"),
    401: (401, "authentication_error"),
    403: (403, "permission_error"),
    404: (404, "not_found_error"),
    413: (413, "request_too_large"),
    429: (429, "rate_limit_error"),
    503: (529, "overloaded_error"),
    504: (504, "timeout_error"),
}


def is_messages_path(path: str) -> bool:
    """Whether `path` (below the route prefix) is one of the Messages routes."""
    return path == MESSAGES_PATH or path.startswith(MESSAGES_PATH + "/")


def status_and_type(http_status: int) -> tuple[int, str]:
    """Anthropic's status code and error type for a kvray HTTP status (module doc)."""
    known = BY_STATUS.get(http_status)
    if known is not None:
        return known
    if 400 <= http_status < 500:
        return http_status, "invalid_request_error"
    return 500, "api_error"


def error_body(kind: str, message: str) -> dict[str, Any]:
    return {"type": "error", "error": {"type": kind, "message": message}}


def from_status(http_status: int, message: str) -> tuple[int, dict[str, Any]]:
    """(status, body) of an HTTP error that is not a KvrayError (Starlette's 404, 405)."""
    status, kind = status_and_type(http_status)
    return status, error_body(kind, message)


def from_error(err: KvrayError) -> tuple[int, dict[str, Any]]:
    """(status, body) of a kvray error on a Messages route. A message that does not already
    name its field gets it in front (`max_tokens: ...`), as Anthropic's messages do."""
    message = err.message
    if err.param and err.http_status == 400 and not message.startswith(err.param):
        message = f"{err.param}: {message}"
    return from_status(err.http_status, message)

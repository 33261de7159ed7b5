"""cluster.errors: status mapping, OpenAI bodies, pickling, unwrapping Ray's wrappers."""

from __future__ import annotations

import pickle

import pytest
from ray.exceptions import RayTaskError

from cluster.errors import (
    AuthenticationError,
    EngineDeadError,
    InvalidRequestError,
    KvrayError,
    ModelNotFoundError,
    QueueFullError,
    invalid_from_value_error,
    unwrap,
)

ALL = [
    InvalidRequestError("top_p", "top_p must be in (0, 1]"),
    QueueFullError("busy", retry_after_s=3),
    EngineDeadError("gone"),
    ModelNotFoundError("nope"),
    AuthenticationError(),
    KvrayError("boom"),
]


@pytest.mark.parametrize("err", ALL, ids=lambda e: type(e).__name__)
def test_pickle_round_trip_keeps_type_and_fields(err: KvrayError) -> None:
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is type(err)
    assert back.__dict__ == err.__dict__ and str(back) == str(err)


def test_status_codes_and_openai_body() -> None:
    assert [e.http_status for e in ALL] == [400, 429, 503, 404, 401, 500]
    assert [e.grpc_code for e in ALL[:4]] == [
        "INVALID_ARGUMENT",
        "RESOURCE_EXHAUSTED",
        "UNAVAILABLE",
        "NOT_FOUND",
    ]
    body = ALL[0].to_openai()["error"]
    assert body == {
        "message": "top_p must be in (0, 1]",
        "type": "invalid_request_error",
        "param": "top_p",
        "code": 400,
    }
    assert ALL[0].field == "top_p" and ALL[1].retry_after_s == 3
    assert ModelNotFoundError("x").param == "model"


def test_unwrap_strips_ray_task_error() -> None:
    cause = QueueFullError("busy")
    wrapped = RayTaskError("generate", "Traceback ...", cause).as_instanceof_cause()
    assert isinstance(wrapped, RayTaskError)
    got = unwrap(wrapped)
    assert type(got) is QueueFullError and got.message == "busy"
    plain = RayTaskError("generate", "Traceback ...", ValueError("x"))
    assert unwrap(plain) is plain
    assert unwrap(cause) is cause


def test_value_error_names_its_field() -> None:
    assert invalid_from_value_error(ValueError("top_k must be -1 or >= 1")).param == "top_k"
    err = invalid_from_value_error(ValueError("prompt is 9 tokens"), default_field="prompt")
    assert err.param == "prompt"
    assert invalid_from_value_error(ValueError("1 is bad"), default_field="x").param == "x"

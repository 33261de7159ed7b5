"""cluster.errors: status mapping, OpenAI bodies, pickling, unwrapping Ray's wrappers, and the
one mapping of what a handle call raises (Ray's own exception classes, constructed for real)."""

from __future__ import annotations

import pickle

import pytest
from ray.exceptions import RayTaskError

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
    as_kvray_error,
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
    QueueTimeoutError("waited too long", retry_after_s=15),
    RequestTimeoutError("ran too long"),
    DrainingError(),
]


@pytest.mark.parametrize("err", ALL, ids=lambda e: type(e).__name__)
def test_pickle_round_trip_keeps_type_and_fields(err: KvrayError) -> None:
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is type(err)
    assert back.__dict__ == err.__dict__ and str(back) == str(err)


def test_status_codes_and_openai_body() -> None:
    assert [e.http_status for e in ALL] == [400, 429, 503, 404, 401, 500, 503, 504, 503]
    assert [e.grpc_code for e in ALL[-3:]] == ["UNAVAILABLE", "DEADLINE_EXCEEDED", "UNAVAILABLE"]
    assert ALL[-3].retry_after_s == 15  # the HTTP ingress sends it as Retry-After
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


def test_only_overload_errors_carry_retry_after_headers() -> None:
    headers = {type(e).__name__: e.http_headers() for e in ALL}
    assert headers.pop("QueueFullError") == {"Retry-After": "3"}
    assert headers.pop("QueueTimeoutError") == {"Retry-After": "15"}
    assert set(map(len, headers.values())) == {0}
    # The field survives Ray's pickling, so the header does too.
    assert pickle.loads(pickle.dumps(ALL[1])).http_headers() == {"Retry-After": "3"}


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


def _ray_errors() -> list[tuple[BaseException, type[KvrayError], int, str]]:
    """What a handle call can raise (Ray's real classes) -> class, HTTP status, gRPC code."""
    from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError
    from ray.serve.exceptions import (
        BackPressureError,
        DeploymentUnavailableError,
        ReplicaUnavailableError,
    )

    from cluster.ray_internals import deployment_id

    dead = (EngineDeadError, 503, "UNAVAILABLE")
    return [
        (BackPressureError(num_queued_requests=9, max_queued_requests=8),
         QueueFullError, 429, "RESOURCE_EXHAUSTED"),
        (DeploymentUnavailableError(deployment_id("LLMServer", "kvray")), *dead),
        (ReplicaUnavailableError("LLMServer#x1"), *dead),
        (RayActorError(), *dead),
        (ActorDiedError(), *dead),
        (ActorUnavailableError("the actor is restarting", None), *dead),
        (RuntimeError("boom"), KvrayError, 500, "INTERNAL"),
    ]  # fmt: skip


def test_one_mapping_for_what_a_handle_call_raises() -> None:
    for exc, cls, status, code in _ray_errors():
        err = as_kvray_error(exc)
        assert type(err) is cls, exc
        assert (err.http_status, err.grpc_code) == (status, code), exc
        assert err.message


def test_the_mapping_passes_kvray_errors_through_ray_wrappers() -> None:
    for err in ALL:
        assert as_kvray_error(err) is err
    cause = InvalidRequestError("top_p", "top_p must be in (0, 1]")
    wrapped = RayTaskError("generate", "Traceback ...", cause).as_instanceof_cause()
    got = as_kvray_error(wrapped)
    assert type(got) is InvalidRequestError and got.param == "top_p"


def test_one_engine_dead_error_for_the_engine_and_the_cluster() -> None:
    # The engine's class is the cluster's: what an engine raises is a 503 that migrates.
    import workers.errors

    assert EngineDeadError is workers.errors.EngineDeadError
    assert KvrayError is workers.errors.KvrayError
    err = workers.errors.EngineDeadError("engine failed: boom")
    assert isinstance(err, RuntimeError) and (err.cause, err.replica) == ("engine_died", None)
    assert as_kvray_error(err) is err and err.http_status == 503
    wrapped = RayTaskError("generate", "Traceback ...", err).as_instanceof_cause()
    got = unwrap(wrapped)
    assert type(got) is EngineDeadError and got.message == "engine failed: boom"
    back = pickle.loads(pickle.dumps(EngineDeadError("gone", cause="replica_died", replica="r1")))
    assert (back.cause, back.replica, back.message) == ("replica_died", "r1", "gone")

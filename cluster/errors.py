"""Errors a request can end with, shared by the HTTP and gRPC ingresses.

The base `KvrayError` and `EngineDeadError` are workers.errors' (the engine raises
EngineDeadError too, and workers never import cluster), re-exported here with the others.

LLMServer raises these inside its replica; Ray carries them to the ingress, which maps each
class to one HTTP status / OpenAI error body and one gRPC status code. They pickle by their
constructor arguments (`__reduce__`) so they survive the trip through Ray, and `unwrap`
strips the RayTaskError wrapper that Ray may put around them. `as_kvray_error` is the one
mapping from anything a handle call raises (these, or Ray's own errors) onto these classes.
"""

from __future__ import annotations

import logging

from workers.errors import EngineDeadError, KvrayError

__all__ = [
    "MIGRATION_CAUSES",
    "AuthenticationError",
    "DrainingError",
    "EngineDeadError",
    "InvalidRequestError",
    "KvrayError",
    "ModelNotFoundError",
    "QueueFullError",
    "QueueTimeoutError",
    "RequestTimeoutError",
    "as_kvray_error",
    "invalid_from_value_error",
    "unwrap",
]
# Where these classes are defined: the base and EngineDeadError in workers.errors (the engine
# raises EngineDeadError itself; workers never import cluster), the others here.
_OWN_MODULES = frozenset({__name__, KvrayError.__module__})

logger = logging.getLogger("ray.serve.kvray.errors")


class InvalidRequestError(KvrayError):
    """A request field is invalid; `param` names it (HTTP 400, gRPC INVALID_ARGUMENT)."""

    http_status = 400
    openai_type = "invalid_request_error"
    grpc_code = "INVALID_ARGUMENT"

    def __init__(self, field: str | None, message: str) -> None:
        super().__init__(message, param=field)

    @property
    def field(self) -> str | None:
        return self.param


class QueueFullError(KvrayError):
    """The replica's waiting queue is at its cap (HTTP 429 + Retry-After, RESOURCE_EXHAUSTED).

    `replica`: the engine replica that refused (its Serve id), which the ingress then tries
    another replica instead of (cluster/ingress/migration.py); None: Serve's own queue cap.
    """

    http_status = 429
    openai_type = "rate_limit_exceeded"
    grpc_code = "RESOURCE_EXHAUSTED"

    def __init__(
        self,
        message: str = "server is at capacity",
        retry_after_s: int = 1,
        replica: str | None = None,
    ) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s
        self.replica = replica


# What made a request move to another replica: the label of kvray_request_migrations_total.
MIGRATION_CAUSES = ("engine_died", "replica_died", "replica_unavailable", "no_replica")


class QueueTimeoutError(KvrayError):
    """No replica or engine took the request within queue_timeout_s (HTTP 503 + Retry-After,
    gRPC UNAVAILABLE): the server is overloaded; a retry, later or elsewhere, may succeed."""

    http_status = 503
    openai_type = "service_unavailable"
    grpc_code = "UNAVAILABLE"

    def __init__(self, message: str = "request timed out in the queue", retry_after_s: int = 5):
        super().__init__(message)
        self.retry_after_s = retry_after_s


class DrainingError(KvrayError):
    """The server is shutting down and takes no new requests (HTTP 503, gRPC UNAVAILABLE)."""

    http_status = 503
    openai_type = "service_unavailable"
    grpc_code = "UNAVAILABLE"

    def __init__(self, message: str = "the server is shutting down; retry elsewhere") -> None:
        super().__init__(message)


class RequestTimeoutError(KvrayError):
    """The request ran past request_timeout_s and was aborted (HTTP 504, DEADLINE_EXCEEDED)."""

    http_status = 504
    openai_type = "timeout_error"
    grpc_code = "DEADLINE_EXCEEDED"

    def __init__(self, message: str = "request timed out") -> None:
        super().__init__(message)


class ModelNotFoundError(KvrayError):
    """The request names a model this deployment does not serve (HTTP 404, gRPC NOT_FOUND)."""

    http_status = 404
    openai_type = "not_found_error"
    grpc_code = "NOT_FOUND"

    def __init__(self, model: str) -> None:
        super().__init__(f"the model {model!r} does not exist", param="model")


class AuthenticationError(KvrayError):
    """Missing or wrong API key (HTTP 401, gRPC UNAUTHENTICATED)."""

    http_status = 401
    openai_type = "authentication_error"
    grpc_code = "UNAUTHENTICATED"

    def __init__(self, message: str = "invalid or missing API key") -> None:
        super().__init__(message)


def unwrap(exc: BaseException) -> BaseException:
    """The KvrayError inside a Ray wrapper (RayTaskError and friends), else `exc` itself.

    Ray re-raises a replica's exception as a class deriving from both RayTaskError and the
    original, so `isinstance` usually works already; this makes the mapping code independent
    of that (it falls back to a bare RayTaskError when the dual class cannot be built).
    """
    cur: BaseException | None = exc
    for _ in range(8):  # a short chain; never loop on a cyclic one
        if cur is None:
            break
        if type(cur).__module__ in _OWN_MODULES:
            return cur
        cause = getattr(cur, "cause", None)  # RayTaskError keeps the original here
        cur = cause if isinstance(cause, BaseException) and cause is not cur else cur.__cause__
    return exc


def invalid_from_value_error(
    err: ValueError, default_field: str | None = None
) -> InvalidRequestError:
    """A ValueError from SamplingParams / the engine names its field first ("top_p must be ...")."""
    message = str(err)
    head = message.split(" ", 1)[0].strip("'\"`:")
    field = head if head.isidentifier() else default_field
    return InvalidRequestError(field, message)


def as_kvray_error(exc: BaseException) -> KvrayError:
    """The one mapping of whatever a DeploymentHandle call raises onto the classes above.

    Both ingresses use it, so a failure has the same status on HTTP and gRPC: Serve's own
    queue cap (BackPressureError) is a 429 like the replica's; a deployment or replica that
    cannot be reached, or an actor that died, is 503 / UNAVAILABLE (Serve replaces it, so a
    retry may succeed); anything unexpected is a 500 / INTERNAL.
    """
    inner = unwrap(exc)
    if isinstance(inner, KvrayError):
        return inner
    from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError
    from ray.serve.exceptions import (
        BackPressureError,
        DeploymentUnavailableError,
        ReplicaUnavailableError,
    )

    if isinstance(inner, BackPressureError):
        return QueueFullError("too many requests queued for the engine replicas; retry later")
    if isinstance(inner, DeploymentUnavailableError):
        return EngineDeadError(f"no healthy engine replica: {inner}", cause="no_replica")
    if isinstance(inner, (ReplicaUnavailableError, ActorUnavailableError)):
        return EngineDeadError(
            f"engine replica unavailable: {type(inner).__name__}: {inner}",
            cause="replica_unavailable",
        )
    if isinstance(inner, (RayActorError, ActorDiedError)):
        return EngineDeadError(
            f"engine replica failed: {type(inner).__name__}: {inner}", cause="replica_died"
        )
    logger.error("unexpected error from an engine replica call", exc_info=exc)
    return KvrayError(f"internal error: {type(inner).__name__}: {inner}")

"""Errors a request can end with that the engine raises too, so they are defined here, below
cluster (which must not be imported from workers), and re-exported by `cluster.errors`.

`KvrayError` is the base of every error a kvray request can end with: each class says how it
leaves an API (HTTP status and OpenAI error type, gRPC status code) as plain class
attributes, and pickles by its fields (`__reduce__`), so it survives Ray's trip from a replica
to the ingress and the engine process's pipe. The other classes are in `cluster.errors`.
`EngineDeadError` is the engine's own: callers tell it from bad input (ValueError).
"""

from __future__ import annotations

from typing import Any


class KvrayError(Exception):
    """Base class. Subclasses fix the HTTP status, the OpenAI error type and the gRPC code."""

    http_status = 500
    openai_type = "internal_error"
    grpc_code = "INTERNAL"  # name of a grpc.StatusCode member

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild, (type(self), self.__dict__.copy()))

    def to_openai(self) -> dict[str, Any]:
        """OpenAI's error body: {"error": {"message", "type", "param", "code"}}."""
        return {
            "error": {
                "message": self.message,
                "type": self.openai_type,
                "param": self.param,
                "code": self.http_status,
            }
        }

    def http_headers(self) -> dict[str, str]:
        """The response headers this error adds: Retry-After when it says when to retry
        (429 queue full, 503 queue timeout), so every HTTP layer sends the same."""
        retry_after = getattr(self, "retry_after_s", None)
        return {} if retry_after is None else {"Retry-After": str(retry_after)}


def _rebuild(cls: type[KvrayError], state: dict[str, Any]) -> KvrayError:
    err = cls.__new__(cls)
    Exception.__init__(err, state.get("message", ""))
    err.__dict__.update(state)
    return err


class EngineDeadError(KvrayError, RuntimeError):
    """The engine died (its step loop failed, its process or a TP rank exited): every
    in-flight and later request gets this. From a replica it is HTTP 503 / gRPC UNAVAILABLE,
    and Ray Serve replaces the replica.

    The ingresses migrate a request that fails with it to another replica
    (cluster/ingress/migration.py): `cause` names what failed (a MIGRATION_CAUSES label of
    cluster.errors) and `replica` the replica it failed on, when known, so the next attempt
    avoids it (the replica names itself when it passes on its engine's error).
    """

    http_status = 503
    openai_type = "service_unavailable"
    grpc_code = "UNAVAILABLE"

    def __init__(
        self,
        message: str = "engine is not running",
        cause: str = "engine_died",
        replica: str | None = None,
        taken: bool = True,
    ) -> None:
        super().__init__(message)
        self.cause = cause
        self.replica = replica
        # False: the replica refused the request before anything ran (its engine was dead
        # or restarting), so moving it elsewhere is not charged as a migration.
        self.taken = taken

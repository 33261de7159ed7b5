"""The HTTP ingress's front door: API key, then body size, before the app reads a byte.

FastAPI reads and parses a request's body before it runs any dependency, so an API-key
dependency would let an unauthenticated client make the ingress read (and parse) a body of
any size. This ASGI middleware sits in front of the FastAPI app instead:

1. The API key (cluster/ingress/auth.py) is checked from the headers alone: a bad or missing
   key is a 401 and the body is never read. Every path but the probes (/health, /ready) is
   behind the key, FastAPI's /docs, /redoc and /openapi.json included.
2. A Content-Length over `max_body_bytes` is a 413 at once, unread. A body without one
   (chunked) is read up to the limit and is a 413 as soon as it passes it.
3. A generation request (POST .../completions) beyond `max_in_flight` of them in this
   ingress is a 429 + Retry-After at once, unread: more than the engine replicas can hold
   or queue, which they would refuse anyway, only later. Refusing here costs the event
   loop nothing, so a burst far past the caps neither slows the refusals nor the probes
   (/health) that share this loop.
4. The body, now known to be within the limit, is replayed to the app in one message (the
   app buffers it whole anyway); later `receive` calls (the client's disconnect, which
   streaming responses watch for) go to the server.

Every error leaves as OpenAI's error body, like every other error of the ingress.
"""

from __future__ import annotations

import json
from typing import Any

from cluster.errors import AuthenticationError, KvrayError, QueueFullError
from cluster.ingress.auth import ApiKeyAuth

Scope = dict[str, Any]
Message = dict[str, Any]


class RequestTooLargeError(KvrayError):
    """The HTTP body is over ServeConfig.max_request_body_bytes (HTTP 413)."""

    http_status = 413
    openai_type = "invalid_request_error"
    grpc_code = "RESOURCE_EXHAUSTED"  # gRPC bounds its messages itself; kept for the table

    def __init__(self, limit: int) -> None:
        super().__init__(
            f"request body is over this server's limit of {limit} bytes (max_request_body_bytes)"
        )


class _TooLarge(Exception):
    """The streamed body passed the limit while being read."""


def api_path(scope: Scope) -> str:
    """The request's path below the app's route prefix (Serve passes it as root_path)."""
    path, root = scope.get("path", ""), scope.get("root_path", "")
    if root and path.startswith(root):
        path = path[len(root) :] or "/"
    return path


class RequestGuard:
    """ASGI middleware: auth from the headers, then a bounded, buffered body, then `app`."""

    def __init__(
        self,
        app: Any,
        auth: ApiKeyAuth,
        max_body_bytes: int,
        metrics: Any = None,
        max_in_flight: int | None = None,
    ) -> None:
        self.app = app
        self.auth = auth
        self.max_body_bytes = max_body_bytes
        self.metrics = metrics  # cluster.server.metrics.RouterMetrics, or None
        self.max_in_flight = max_in_flight  # generation requests at once; None: no cap
        self.in_flight = 0

    def __getattr__(self, name: str) -> Any:  # Ray Serve adds exception handlers to the app
        return getattr(self.app, name)

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope.get("type") != "http":
            await self.app(scope, receive, send)
            return
        headers = _headers(scope)
        try:
            self.auth.check_path(api_path(scope), headers.get("authorization"))
        except AuthenticationError as err:
            if self.metrics is not None:
                self.metrics.rejected("unauthenticated")
            await send_error(send, err)
            return
        try:
            declared = int(headers.get("content-length", "0"))
        except ValueError:
            declared = 0  # malformed: the server refuses it; else the byte count below rules
        if declared > self.max_body_bytes:
            await send_error(send, RequestTooLargeError(self.max_body_bytes))
            return
        counted = scope.get("method") == "POST" and api_path(scope).endswith("/completions")
        if counted and self.max_in_flight is not None and self.in_flight >= self.max_in_flight:
            if self.metrics is not None:
                self.metrics.rejected("queue_full")
            await send_error(send, self._full())
            return
        self.in_flight += counted
        try:
            try:
                body = await self._read_body(receive)
            except _TooLarge:
                await send_error(send, RequestTooLargeError(self.max_body_bytes))
                return
            if body is None:
                return  # the client left before sending its whole body: nobody to answer
            await self.app(scope, _replay(body, receive), send)
        finally:
            self.in_flight -= counted

    def _full(self) -> QueueFullError:
        return QueueFullError(
            f"this ingress holds {self.in_flight} generation requests, as many as the engine "
            "replicas can run and queue; retry later"
        )

    async def _read_body(self, receive: Any) -> bytes | None:
        """The whole body (at most max_body_bytes); None if the client disconnected first."""
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message.get("type") != "http.request":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                raise _TooLarge
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)


def _replay(body: bytes, receive: Any) -> Any:
    """`receive` for the app: the buffered body first, then the server's own messages."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


def _headers(scope: Scope) -> dict[str, str]:
    return {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", ())}


async def send_error(send: Any, err: KvrayError) -> None:
    """`err` as a complete JSON response in OpenAI's error format (+ Retry-After)."""
    body = json.dumps(err.to_openai()).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
    ]
    retry_after = getattr(err, "retry_after_s", None)
    if retry_after is not None:
        headers.append((b"retry-after", str(retry_after).encode()))
    await send({"type": "http.response.start", "status": err.http_status, "headers": headers})
    await send({"type": "http.response.body", "body": body})

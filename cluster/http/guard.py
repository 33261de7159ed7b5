"""The HTTP ingress's front door: API key, then body size, before the app reads a byte.

FastAPI reads and parses a request's body before it runs any dependency, so an API-key
dependency would let an unauthenticated client make the ingress read (and parse) a body of
any size. This ASGI middleware sits in front of the FastAPI app instead:

0. The liveness probe (GET /health) is answered here, before anything else, and every other
   request (the readiness probe aside) is paced: at most ADMIT_PER_TICK of them go on per
   turn of the event loop. A burst of 2,000 requests lands on this one loop at once; unpaced,
   each turn ran the parsing, checking and routing of every request that had arrived before
   the loop read the next socket, so a probe arriving then waited for all of them. Paced, the
   app's share of a turn is a few requests' work. The work is the same, in the same order:
   nothing is slower when the loop has time to spare. What runs before this guard (connection
   set-up, HTTP parsing, Ray Serve's per-request wrapper) is not paced and still makes the
   first turns of a large burst long (docs/benchmarks.md, "Overload").
1. The API key (cluster/ingress/auth.py) is checked from the headers alone: a bad or missing
   key is a 401 and the body is never read. Every path but the probes (/health, /ready) is
   behind the key, FastAPI's /docs, /redoc and /openapi.json included. The request's tenant
   (its key's, or its tenant header's: cluster/ingress/tenants.py) is named here too.
2. A Content-Length over `max_body_bytes` is a 413 at once, unread. A body without one
   (chunked) is read up to the limit and is a 413 as soon as it passes it.
3. A generation request (POST .../completions, .../responses, /v1/messages) beyond
   `max_in_flight` of them in this ingress is a 429 + Retry-After at once, unread: more
   than the engine replicas can hold or queue, which they would refuse anyway, only later.
   Refusing here costs the event loop nothing, so a burst far past the caps neither slows
   the refusals nor the probes (/health) that share this loop.
4. The body, now known to be within the limit, is replayed to the app in one message (the
   app buffers it whole anyway); later `receive` calls (the client's disconnect, which
   streaming responses watch for) go to the server.

Every error leaves as OpenAI's error body, like every other error of the ingress, or as
Anthropic's on its Messages routes (cluster/http/messages_errors.py). The API key may come as
`Authorization: Bearer KEY` or `x-api-key: KEY` (cluster/ingress/auth.py).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from cluster.errors import AuthenticationError, InvalidRequestError, KvrayError, QueueFullError
from cluster.http import messages_errors
from cluster.ingress.auth import ApiKeyAuth, with_api_key
from cluster.ingress.tenants import bind_tenant

Scope = dict[str, Any]
Message = dict[str, Any]

# The liveness probe, answered by the guard itself (what FastAPI's /health route answers).
LIVENESS_PATH = "/health"
LIVENESS_BODY = b'{"status":"ok"}'
# Not paced: the readiness probe (it asks an engine replica, cheaply, and Kubernetes must see
# it answer under load too).
UNPACED_PATHS = frozenset({LIVENESS_PATH, "/ready"})
# Generation routes (their path ends): what step 3 counts against max_in_flight.
GENERATION_PATHS = ("/completions", "/responses", "/messages")
# Requests let on per turn of the event loop (step 0): each costs the loop up to a few
# milliseconds (a generation request's parsing, checks and routing), so a turn stays in the
# tens of milliseconds however many requests are waiting.
ADMIT_PER_TICK = 8


class RequestTooLargeError(KvrayError):
    """The HTTP body is over ServeConfig.limits.max_request_body_bytes (HTTP 413)."""

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
        self.metrics = metrics  # cluster.routing.metrics.RouterMetrics, or None
        self.max_in_flight = max_in_flight  # generation requests at once; None: no cap
        self.in_flight = 0
        # Step 0's pacing: taken per request, given back on the next turn of the loop.
        self._turn = asyncio.Semaphore(ADMIT_PER_TICK)

    def __getattr__(self, name: str) -> Any:  # Ray Serve adds exception handlers to the app
        return getattr(self.app, name)

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope.get("type") != "http":
            await self.app(scope, receive, send)
            return
        path = api_path(scope)
        if path == LIVENESS_PATH and scope.get("method") == "GET":
            await send_json(send, 200, LIVENESS_BODY)
            return
        if path not in UNPACED_PATHS:
            await self._next_turn()
        headers = with_api_key(_headers(scope))
        anthropic = messages_errors.is_messages_path(path)
        try:
            self.auth.check_path(path, headers.get("authorization"))
            bind_tenant(self.auth, path, headers)  # for the routes (cluster/ingress/tenants.py)
        except AuthenticationError as err:
            if self.metrics is not None:
                self.metrics.rejected("unauthenticated")
            await send_error(send, err, anthropic)
            return
        except InvalidRequestError as err:  # a tenant header that names no tenant: 400
            await send_error(send, err, anthropic)
            return
        try:
            declared = int(headers.get("content-length", "0"))
        except ValueError:
            declared = 0  # malformed: the server refuses it; else the byte count below rules
        if declared > self.max_body_bytes:
            await send_error(send, RequestTooLargeError(self.max_body_bytes), anthropic)
            return
        counted = scope.get("method") == "POST" and path.endswith(GENERATION_PATHS)
        if counted and self.max_in_flight is not None and self.in_flight >= self.max_in_flight:
            if self.metrics is not None:
                self.metrics.rejected("queue_full")
            await send_error(send, self._full(), anthropic)
            return
        self.in_flight += counted
        try:
            try:
                body = await self._read_body(receive)
            except _TooLarge:
                await send_error(send, RequestTooLargeError(self.max_body_bytes), anthropic)
                return
            if body is None:
                return  # the client left before sending its whole body: nobody to answer
            await self.app(scope, _replay(body, receive), send)
        finally:
            self.in_flight -= counted

    async def _next_turn(self) -> None:
        """Waits until this turn of the event loop has let fewer than ADMIT_PER_TICK requests
        on (step 0). Waiters go on in arrival order."""
        await self._turn.acquire()
        asyncio.get_running_loop().call_soon(self._turn.release)

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


async def send_error(send: Any, err: KvrayError, anthropic: bool = False) -> None:
    """`err` as a complete JSON response in OpenAI's error format (+ Retry-After), or in
    Anthropic's (`anthropic`: a Messages route)."""
    extra = [(k.lower().encode(), v.encode()) for k, v in err.http_headers().items()]
    status, body = err.http_status, err.to_openai()
    if anthropic:
        status, body = messages_errors.from_error(err)
    await send_json(send, status, json.dumps(body).encode(), extra)


async def send_json(
    send: Any, status: int, body: bytes, extra: list[tuple[bytes, bytes]] | None = None
) -> None:
    """A complete response with a JSON `body`."""
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        *(extra or ()),
    ]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})

"""RequestGuard: the API key and the body-size bound, before the app reads the body.

Driven as ASGI directly (no server): `receive` records how much of the body was pulled, so a
test can tell that a refused request's body was never read.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest

from cluster.http.guard import RequestGuard, api_path
from cluster.ingress.auth import ApiKeyAuth

KEY = "sk-test"
LIMIT = 1000


async def echo_app(scope: dict, receive: Any, send: Any) -> None:
    """A real ASGI app: answers with the size of the body it read."""
    size = 0
    while True:
        message = await receive()
        size += len(message.get("body", b""))
        if not message.get("more_body"):
            break
    body = json.dumps({"read": size}).encode()
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": body})


class Call:
    """One request through the guard, with a body sent in chunks."""

    def __init__(self, chunks: list[bytes], headers: dict[str, str], path: str = "/v1/completions"):
        self.chunks = list(chunks)
        self.pulled = 0  # body messages the guard (or the app) asked for
        self.sent: list[dict] = []
        self.scope = {
            "type": "http",
            "method": "POST",
            "path": path,
            "root_path": "",
            "headers": [(k.lower().encode(), v.encode()) for k, v in headers.items()],
        }

    async def receive(self) -> dict:
        if not self.chunks:
            await asyncio.Event().wait()  # nothing more: a real server waits for disconnect
        self.pulled += 1
        chunk = self.chunks.pop(0)
        return {"type": "http.request", "body": chunk, "more_body": bool(self.chunks)}

    async def send(self, message: dict) -> None:
        self.sent.append(message)

    def run(self, auth: ApiKeyAuth) -> tuple[int, dict]:
        guard = RequestGuard(echo_app, auth, LIMIT)
        asyncio.run(guard(self.scope, self.receive, self.send))
        status = self.sent[0]["status"]
        return status, json.loads(self.sent[1]["body"])


def _openai_error(body: dict, status: int) -> dict:
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == status
    return err


def test_no_key_is_401_without_reading_the_body() -> None:
    call = Call([b"x" * 100] * 50, {"content-length": "5000"})
    status, body = call.run(ApiKeyAuth(KEY))
    assert status == 401 and call.pulled == 0
    assert _openai_error(body, 401)["type"] == "authentication_error"


def test_wrong_key_is_401_even_for_a_small_body() -> None:
    call = Call([b"{}"], {"authorization": "Bearer nope"})
    assert call.run(ApiKeyAuth(KEY))[0] == 401 and call.pulled == 0


def test_declared_oversize_is_413_without_reading() -> None:
    call = Call([b"x" * 2000], {"authorization": f"Bearer {KEY}", "content-length": "2000"})
    status, body = call.run(ApiKeyAuth(KEY))
    assert status == 413 and call.pulled == 0
    err = _openai_error(body, 413)
    assert "max_request_body_bytes" in err["message"] and str(LIMIT) in err["message"]


def test_streamed_oversize_is_413_once_past_the_limit() -> None:
    # Chunked (no Content-Length): reading stops at the chunk that passes the limit.
    call = Call([b"x" * 400] * 10, {"authorization": f"Bearer {KEY}"})
    status, body = call.run(ApiKeyAuth(KEY))
    assert status == 413 and call.pulled == 3
    _openai_error(body, 413)


def test_a_body_within_the_limit_reaches_the_app_whole() -> None:
    call = Call([b"x" * 300] * 3 + [b"x" * 100], {"authorization": f"Bearer {KEY}"})
    assert call.run(ApiKeyAuth(KEY)) == (200, {"read": LIMIT})


def test_probes_are_open_and_auth_off_without_a_key() -> None:
    assert Call([b""], {}, path="/health").run(ApiKeyAuth(KEY)) == (200, {"read": 0})
    assert Call([b"abc"], {}).run(ApiKeyAuth(None)) == (200, {"read": 3})


def test_docs_are_behind_the_key() -> None:
    for path in ("/docs", "/redoc", "/openapi.json"):
        assert Call([b""], {}, path=path).run(ApiKeyAuth(KEY))[0] == 401


def test_path_is_below_the_route_prefix() -> None:
    assert api_path({"path": "/main/health", "root_path": "/main"}) == "/health"
    assert api_path({"path": "/main", "root_path": "/main"}) == "/"
    assert api_path({"path": "/v1/models", "root_path": ""}) == "/v1/models"


@pytest.mark.parametrize("length", ["abc", "-1"])
def test_a_malformed_content_length_falls_back_to_counting(length: str) -> None:
    call = Call([b"x" * 2000], {"authorization": f"Bearer {KEY}", "content-length": length})
    assert call.run(ApiKeyAuth(KEY))[0] == 413


def test_through_an_http_client() -> None:
    async def main() -> list[int]:
        guard = RequestGuard(echo_app, ApiKeyAuth(KEY), LIMIT)
        transport = httpx.ASGITransport(app=guard)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            auth = {"authorization": f"Bearer {KEY}"}
            return [
                (await client.post("/v1/completions", content=b"x" * 10)).status_code,
                (await client.post("/v1/completions", content=b"x" * 10, headers=auth)).status_code,
                (
                    await client.post("/v1/completions", content=b"x" * 5000, headers=auth)
                ).status_code,
            ]

    assert asyncio.run(main()) == [401, 200, 413]


def test_generation_requests_beyond_the_cap_are_429_unread_and_probes_still_pass() -> None:
    """Two generation requests held by a slow app fill a cap of 2: the third is a 429 with
    Retry-After before its body is read, a probe still reaches the app, and once the two
    end the next one is served."""
    gate = asyncio.Event()

    async def slow_app(scope: dict, receive: Any, send: Any) -> None:
        if scope["path"].endswith("/completions"):
            await gate.wait()
        await echo_app(scope, receive, send)

    async def main() -> list[tuple[int, dict, dict]]:
        guard = RequestGuard(slow_app, ApiKeyAuth(None), LIMIT, max_in_flight=2)
        calls = [Call([b"{}"], {}) for _ in range(2)]
        held = [asyncio.create_task(guard(c.scope, c.receive, c.send)) for c in calls]
        await asyncio.sleep(0.05)
        over, probe = Call([b"{}"], {}), Call([b""], {}, path="/health")
        await guard(over.scope, over.receive, over.send)
        await guard(probe.scope, probe.receive, probe.send)
        assert over.pulled == 0 and guard.in_flight == 2
        gate.set()
        await asyncio.gather(*held)
        after = Call([b"{}"], {})
        await guard(after.scope, after.receive, after.send)
        assert guard.in_flight == 0
        return [
            (c.sent[0]["status"], dict(c.sent[0]["headers"]), json.loads(c.sent[1]["body"]))
            for c in (over, probe, after)
        ]

    (over, o_headers, o_body), (probe, _, _), (after, _, _) = asyncio.run(main())
    assert over == 429 and o_headers[b"retry-after"] == b"1"
    assert _openai_error(o_body, 429)["type"] == "rate_limit_exceeded"
    assert probe == 200 and after == 200


def test_the_ingress_cap_is_what_the_replicas_can_hold() -> None:
    from cluster.config import ServeConfig

    one = ServeConfig.from_flat(max_ongoing_requests=256, max_queued_requests=128)
    assert one.ingress_max_in_flight() == 2 * 256 + 128
    scaled = ServeConfig.from_flat(min_replicas=0, max_replicas=3, ingress_replicas=2)
    assert scaled.ingress_max_in_flight() == -(-(4 * 256 + 128) // 2)


def test_responses_requests_count_against_the_cap_too() -> None:
    """POST /v1/responses is a generation request: one held fills a cap of 1, so the next
    generation request (either route) is a 429, while other routes still reach the app."""
    gate = asyncio.Event()

    async def slow_app(scope: dict, receive: Any, send: Any) -> None:
        if scope["path"].endswith("/responses"):
            await gate.wait()
        await echo_app(scope, receive, send)

    async def main() -> list[int]:
        guard = RequestGuard(slow_app, ApiKeyAuth(None), LIMIT, max_in_flight=1)
        held = Call([b"{}"], {}, path="/v1/responses")
        task = asyncio.create_task(guard(held.scope, held.receive, held.send))
        await asyncio.sleep(0.05)
        assert guard.in_flight == 1
        calls = [Call([b"{}"], {}, path=p) for p in ("/v1/responses", "/v1/completions")]
        calls.append(Call([b"{}"], {}, path="/tokenize"))
        for c in calls:
            await guard(c.scope, c.receive, c.send)
        gate.set()
        await task
        assert guard.in_flight == 0
        return [c.sent[0]["status"] for c in (*calls, held)]

    assert asyncio.run(main()) == [429, 429, 200, 200]


def test_the_app_sees_the_tenant_and_a_bad_tenant_header_is_400_unread() -> None:
    from cluster.ingress.tenants import TenantAuth, current_tenant

    async def tenant_app(scope: dict, receive: Any, send: Any) -> None:
        await receive()
        body = json.dumps({"tenant": current_tenant()}).encode()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": body})

    auth = TenantAuth(KEY, header="x-tenant-id")
    key = {"authorization": f"Bearer {KEY}"}
    for headers, tenant in (({"x-tenant-id": "acme"}, "acme"), ({}, "default")):
        call = Call([b"{}"], {**key, **headers})
        asyncio.run(RequestGuard(tenant_app, auth, LIMIT)(call.scope, call.receive, call.send))
        assert json.loads(call.sent[1]["body"]) == {"tenant": tenant}
    call = Call([b"{}"], {**key, "x-tenant-id": "no spaces please"})
    status, body = call.run(auth)
    assert status == 400 and call.pulled == 0
    assert _openai_error(body, 400)["param"] == "x-tenant-id"
    assert Call([b"{}"], {"x-tenant-id": "acme"}).run(auth)[0] == 401  # the key still rules


def test_x_api_key_is_a_key_and_messages_routes_answer_in_anthropics_shape() -> None:
    ok = Call([b"{}"], {"x-api-key": KEY}, path="/v1/messages")
    assert ok.run(ApiKeyAuth(KEY)) == (200, {"read": 2})
    wrong = Call([b"{}"], {"x-api-key": "nope"}, path="/v1/messages")
    status, body = wrong.run(ApiKeyAuth(KEY))
    assert status == 401 and wrong.pulled == 0
    assert body == {
        "type": "error",
        "error": {"type": "authentication_error", "message": "invalid API key"},
    }
    # Other routes take it too, and answer in OpenAI's shape.
    assert Call([b"{}"], {"x-api-key": KEY}).run(ApiKeyAuth(KEY))[0] == 200
    status, body = Call([b"{}"], {"x-api-key": "nope"}).run(ApiKeyAuth(KEY))
    assert status == 401 and _openai_error(body, 401)["type"] == "authentication_error"

"""The client of `kvray bench serve --chaos` against a small local server that answers each
way a chaos run can see: complete answers (streamed and not, completions and chat), errors
with and without OpenAI's body, an error frame mid-stream, a stream cut short, no server."""

from __future__ import annotations

import asyncio
import http.server
import json
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from cluster.bench.chaos.client import (
    ERROR,
    LOST,
    OK,
    ChaosClient,
    ChaosResult,
    TenantIdentity,
    keys_file_identity,
)
from cluster.bench.chaos.workload import ChaosRequest
from cluster.bench.common.backend_types import BackendContext


class _Server(http.server.BaseHTTPRequestHandler):
    """What it answers is chosen by the request's max_tokens (the test's switch)."""

    seen: list[tuple[str, dict, dict]] = []

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        _Server.seen.append((self.path, body, {k.lower(): v for k, v in self.headers.items()}))
        mode = body["max_tokens"]
        if mode in (503, 502):
            self.send_response(mode)
            self.end_headers()
            err = {"error": {"message": "no replica", "type": "x", "code": 503}}
            self.wfile.write(json.dumps(err).encode() if mode == 503 else b"<html>bad gateway")
            return
        self.send_response(200)
        if not body["stream"]:
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            choice = (
                {"message": {"role": "assistant", "content": "hello"}}
                if "messages" in body
                else {"text": "hello"}
            )
            out = {
                "choices": [{**choice, "finish_reason": "length"}],
                "usage": {"completion_tokens": 2},
            }
            self.wfile.write(json.dumps(out).encode())
            return
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        chat = "messages" in body
        frames = [
            {"choices": [{"delta": {"role": "assistant"}}]} if chat else None,
            {"choices": [{"delta": {"content": "hel"}} if chat else {"text": "hel"}]},
            {"choices": [{"delta": {"content": "lo"}} if chat else {"text": "lo"}]},
        ]
        if mode == 7:  # an error frame mid-stream
            frames.append({"error": {"message": "engine died", "code": 503}})
        elif mode != 8:  # 8: cut short, no finish reason and no usage
            frames += [
                {"choices": [{"delta": {}, "finish_reason": "length"}]},
                {"choices": [], "usage": {"completion_tokens": 2}},
            ]
        for f in frames:
            if f is not None:
                self.wfile.write(b"data: " + json.dumps(f).encode() + b"\n\n")
                self.wfile.flush()
        if mode != 8:
            self.wfile.write(b"data: [DONE]\n\n")

    def log_message(self, *_: object) -> None:
        pass


@pytest.fixture
def server() -> Iterator[str]:
    s = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Server)
    thread = threading.Thread(target=s.serve_forever, daemon=True)
    thread.start()
    _Server.seen.clear()
    yield f"http://127.0.0.1:{s.server_address[1]}"
    s.shutdown()
    s.server_close()


def _req(max_tokens: int, api: str = "completions", stream: bool = False) -> ChaosRequest:
    return ChaosRequest(
        0, api, stream, max_tokens, priority=5, tenant=1, prompt_ids=(4, 5), message="hi"
    )


def _send(url: str, reqs: list[ChaosRequest], identity: TenantIdentity) -> list[ChaosResult]:
    async def go() -> list[ChaosResult]:
        client = ChaosClient.open(BackendContext("m", "", base_url=url), identity, 30.0)
        try:
            return [await client.send(r) for r in reqs]
        finally:
            await client.close()

    return asyncio.run(go())


def test_every_answer_becomes_ok_error_or_lost(server: str) -> None:
    reqs = [
        _req(2),
        _req(2, "chat"),
        _req(2, stream=True),
        _req(2, "chat", stream=True),
        _req(503),
        _req(502),
        _req(7, stream=True),
        _req(8, "chat", stream=True),
    ]
    got = _send(server, reqs, TenantIdentity(header="x-tenant-id"))
    for r in got[:4]:
        assert (r.outcome, r.text, r.finish_reason, r.completion_tokens) == (
            OK,
            "hello",
            "length",
            2,
        )
        assert r.sent <= r.end
    assert got[0].ttft is None and got[2].ttft is not None and got[3].ttft is not None
    assert (got[4].outcome, got[4].status, got[4].clear, got[4].error) == (
        ERROR, "503", True, "no replica",
    )  # fmt: skip
    assert (got[5].outcome, got[5].status, got[5].clear) == (ERROR, "502", False)
    assert (got[6].outcome, got[6].status, got[6].error) == (ERROR, "503", "engine died")
    assert (got[7].outcome, got[7].status) == (LOST, "truncated")
    path, body, headers = _Server.seen[1]
    assert path == "/v1/chat/completions" and body["priority"] == 5
    assert headers["x-tenant-id"] == "tenant-1" and "authorization" not in headers
    path, body, _ = _Server.seen[0]
    assert path == "/v1/completions" and body["prompt"] == [4, 5]


def test_no_server_is_a_lost_request() -> None:
    (r,) = _send("http://127.0.0.1:1", [_req(2)], TenantIdentity())
    assert (r.outcome, r.status) == (LOST, "connection") and r.error


def test_tenants_by_key_come_from_a_keys_file(server: str, tmp_path: Path) -> None:
    path = tmp_path / "keys.yaml"
    path.write_text(
        "keys:\n  - {key: sk-a1, name: acme}\n  - {key: sk-a2, name: acme}\n"
        "  - {key: sk-b1, name: bolt}\n  - {key: sk-c1}\n"
    )
    ident = keys_file_identity(path, 2)
    assert ident.keys == ("sk-a1", "sk-b1") and (ident.name(0), ident.name(1)) == ("acme", "bolt")
    _send(server, [_req(2)], ident)  # tenant 1
    headers = _Server.seen[0][2]
    assert headers["authorization"] == "Bearer sk-b1" and "x-tenant-id" not in headers
    assert TenantIdentity().headers(0, "k")["Authorization"] == "Bearer k"
    with pytest.raises(ValueError, match="names 3 tenant"):
        keys_file_identity(path, 4)

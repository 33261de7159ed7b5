"""The gateway's `x-gateway-destination-endpoint` header becomes the engine requests' preferred
node (no Ray: the node directory's lookup is a stand-in)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from cluster.http.gateway_hint import (
    MISS_RETRY_S,
    REFRESH_S,
    GatewayHint,
    NodeDirectory,
    endpoint_host,
    hinted,
)
from tests.cluster.routing.routing_kit import generate_request

OWN = ("10.0.0.5", "node-own")


@pytest.mark.parametrize(
    ("value", "host"),
    [
        ("10.0.0.7:8000", "10.0.0.7"),
        (" 10.0.0.7:8000 , 10.0.0.8:8000", "10.0.0.7"),  # the picker's choice, then fallbacks
        ("10.0.0.7", "10.0.0.7"),
        ("[fd00::7]:8000", "fd00::7"),
        ("fd00::7", "fd00::7"),
        ("pod.example:8000", None),  # not an IP
        ("", None),
    ],
)
def test_endpoint_host(value: str, host: str | None) -> None:
    assert endpoint_host(value) == host


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_directory_reads_the_cluster_rarely() -> None:
    calls: list[int] = []
    nodes = {"10.0.0.7": "node-7"}

    def list_nodes() -> dict[str, str]:
        calls.append(1)
        return dict(nodes)

    clock = Clock()
    d = NodeDirectory(list_nodes, own=OWN, clock=clock)

    async def go() -> None:
        assert await d.node_of("10.0.0.5") == "node-own"  # its own node: no call
        assert calls == []
        assert await d.node_of("10.0.0.7") == "node-7"
        assert await d.node_of("10.0.0.7") == "node-7"
        assert len(calls) == 1
        # A pod that just joined: looked up again, but not at every request.
        nodes["10.0.0.9"] = "node-9"
        assert await d.node_of("10.0.0.9") is None
        assert len(calls) == 1
        clock.now += MISS_RETRY_S
        assert await d.node_of("10.0.0.9") == "node-9"
        assert len(calls) == 2
        # Nodes that left are dropped at the next refresh.
        del nodes["10.0.0.7"]
        clock.now += REFRESH_S
        assert await d.node_of("10.0.0.7") is None

    asyncio.run(go())


def test_a_failed_lookup_means_no_preference() -> None:
    def broken() -> dict[str, str]:
        raise RuntimeError("GCS unavailable")

    assert asyncio.run(NodeDirectory(broken, own=OWN).node_of("10.0.0.7")) is None


def _serve(hint: GatewayHint, headers: list[tuple[bytes, bytes]]) -> None:
    """One HTTP request through the wrapper."""
    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": headers}

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b""}

    async def send(message: dict[str, Any]) -> None:
        pass

    asyncio.run(hint(scope, receive, send))


def test_the_header_reaches_the_engine_requests() -> None:
    seen: list[Any] = []

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        reqs = hinted([generate_request([1] * 20, request_id=f"r{i}") for i in range(2)])
        seen.append([r.prefer_node_id for r in reqs])

    nodes = {"10.0.0.7": "node-7"}
    hint = GatewayHint(app, NodeDirectory(lambda: nodes, own=OWN))
    _serve(hint, [(b"x-gateway-destination-endpoint", b"10.0.0.7:8000")])
    _serve(hint, [(b"X-Gateway-Destination-Endpoint", b"10.0.0.5:8000")])  # any case
    _serve(hint, [(b"content-type", b"application/json")])  # not through a gateway
    _serve(hint, [(b"x-gateway-destination-endpoint", b"10.9.9.9:8000")])  # no such node
    assert seen == [["node-7"] * 2, ["node-own"] * 2, [None] * 2, [None] * 2]
    # Outside a request (and after one) nothing is preferred.
    assert hinted([generate_request([1] * 20)])[0].prefer_node_id is None


def test_the_wrapper_passes_other_scopes_and_attributes_through() -> None:
    class App:
        marker = "the app's"

        async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
            calls.append(scope["type"])

    calls: list[str] = []
    hint = GatewayHint(App(), NodeDirectory(dict, own=OWN))
    assert hint.marker == "the app's"  # Ray Serve reaches the FastAPI app through wrappers
    asyncio.run(hint({"type": "lifespan"}, None, None))
    assert calls == ["lifespan"]

"""The pod a Kubernetes inference gateway chose, as a node preference for kvray's router.

With the Gateway API Inference Extension, the gateway asks its endpoint picker for a pod of the
InferencePool (kvray's engine pods, picked on the vLLM-named gauges each engine replica
serves: cluster/replica/gateway_metrics.py) and sends the request to that pod's Serve HTTP
port, naming the pod in the header `x-gateway-destination-endpoint: <podIP>:<port>` (a comma
list when the picker adds fallbacks: the first is its choice). The pod's proxy hands the
request to an HTTP ingress replica, which may run on another node; the ingress then routes it
through kvray's own router, which would otherwise ignore the picker's choice.

So the HTTP ingress turns the header into the Ray node id of that pod (on KubeRay a Ray node
is a pod, and its node IP the pod's IP) and its generation requests carry it as
`GenerateRequest.prefer_node_id`; the router sends them to a replica on that node while one
there has room (cluster/routing/router.py). A header naming no Ray node (another port's IP, a
pod gone) adds no preference.

`GatewayHint` wraps the ingress's ASGI app: it reads the header once per request and keeps
the node id in a ContextVar, so the routes, which see only their bodies, need no change;
`hinted` applies it to the engine requests the ingress sends.
"""

from __future__ import annotations

import asyncio
import dataclasses
import ipaddress
import time
from collections.abc import Callable, Iterable
from contextvars import ContextVar
from typing import Any

from cluster.messages import GenerateRequest

HEADER = b"x-gateway-destination-endpoint"
# A node IP not in the directory is looked up again after this long (a pod that just joined);
# the whole directory is refreshed after REFRESH_S (pods that left, IPs reused).
MISS_RETRY_S = 5.0
REFRESH_S = 60.0

# The node the request this task serves prefers (None: none); each request's task has its own.
_PREFER_NODE: ContextVar[str | None] = ContextVar("kvray_prefer_node", default=None)


def endpoint_host(value: str) -> str | None:
    """The IP of the first endpoint in a header value `ip:port[,ip:port...]` (IPv6 as
    `[addr]:port`); None when it is not one."""
    first = value.split(",", 1)[0].strip()
    if first.startswith("["):
        host = first[1:].split("]", 1)[0]
    else:
        host = first.rsplit(":", 1)[0] if first.count(":") == 1 else first
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        return None


def hinted(requests: Iterable[GenerateRequest]) -> list[GenerateRequest]:
    """The engine requests, each preferring the node this request's gateway chose (if any)."""
    node = _PREFER_NODE.get()
    if node is None:
        return list(requests)
    return [dataclasses.replace(r, prefer_node_id=node) for r in requests]


def ray_alive_nodes() -> dict[str, str]:
    """Node IP -> Ray node id of the cluster's live nodes (a GCS call: blocking)."""
    import ray

    return {n["NodeManagerAddress"]: n["NodeID"] for n in ray.nodes() if n.get("Alive")}


def own_node() -> tuple[str, str]:
    """(node IP, node id) of the node this process runs on."""
    import ray

    return ray.util.get_node_ip_address(), ray.get_runtime_context().get_node_id()


class NodeDirectory:
    """Node IP -> Ray node id, read from the cluster (`list_nodes`, off the event loop) when
    needed and kept (module constants say how long). Its own node is known without a call."""

    def __init__(
        self,
        list_nodes: Callable[[], dict[str, str]] = ray_alive_nodes,
        own: tuple[str, str] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._list_nodes = list_nodes
        self._own = own
        self._clock = clock
        self._by_ip: dict[str, str] = {}
        self._fetched_at: float | None = None

    async def node_of(self, ip: str) -> str | None:
        if self._own is not None and ip == self._own[0]:
            return self._own[1]
        now = self._clock()
        age = None if self._fetched_at is None else now - self._fetched_at
        if age is None or age >= REFRESH_S or (ip not in self._by_ip and age >= MISS_RETRY_S):
            self._fetched_at = now  # before the call: concurrent misses wait for this one
            try:
                self._by_ip = await asyncio.to_thread(self._list_nodes)
            except Exception:  # the hint is an optimisation: route without it
                return self._by_ip.get(ip)
        return self._by_ip.get(ip)


class GatewayHint:
    """ASGI wrapper: a request with the gateway's header is served preferring its pod's node
    (module doc); without the header nothing is looked up."""

    def __init__(self, app: Any, directory: NodeDirectory | None = None) -> None:
        self.app = app
        self._directory = directory

    def __getattr__(self, name: str) -> Any:  # Ray Serve adds exception handlers to the app
        return getattr(self.app, name)

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        value = _header(scope) if scope.get("type") == "http" else None
        ip = endpoint_host(value) if value else None
        if ip is None:
            await self.app(scope, receive, send)
            return
        if self._directory is None:  # made on first use: in the replica, where Ray runs
            self._directory = NodeDirectory(own=own_node())
        token = _PREFER_NODE.set(await self._directory.node_of(ip))
        try:
            await self.app(scope, receive, send)
        finally:
            _PREFER_NODE.reset(token)


def _header(scope: dict[str, Any]) -> str | None:
    for key, value in scope.get("headers") or ():
        if key.lower() == HEADER:
            return bytes(value).decode("latin-1")
    return None

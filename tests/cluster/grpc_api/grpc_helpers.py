"""What the gRPC end-to-end modules share: their prompts, the offline engine's answers, a
handle on the deployed app, and polling / status helpers. The fixtures that build them are in
conftest.py next to this file."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc
import pytest

from cluster.grpc_api.client import KvrayClient
from tests.cluster.serve_helpers import API_KEY

MAX_QUEUED = 2  # small, so a flood gets RESOURCE_EXHAUSTED
PROMPTS = ["Hello world, this is", "The capital of France"]
CHAT = [{"role": "user", "content": "Tell me a story about a river."}]
CHAT_MAX_TOKENS = 12
LONG = 1500  # max_tokens of requests that must be aborted long before they could finish
WAIT_S = 600.0  # liveness bound of polling loops (never a timing assertion)


def poll(check: Callable[[], Any], what: str, interval: float = 0.05) -> Any:
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        result = check()
        if result:
            return result
        time.sleep(interval)
    raise AssertionError(f"gave up waiting for {what}")


def health(port: int, service: str = "") -> int | None:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        try:
            resp = health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=10
            )
        except grpc.RpcError:
            return None
        return resp.status


def wait_serving(port: int) -> None:
    from grpc_health.v1 import health_pb2

    poll(
        lambda: health(port) == health_pb2.HealthCheckResponse.SERVING,
        f"gRPC health SERVING on port {port} (is GrpcIngress bound in "
        "cluster.deploy.app.build_app?)",
        interval=0.5,
    )


@dataclass
class Offline:
    texts: list[str]
    token_ids: list[list[int]]
    ids_prompt: list[int]
    ids_prompt_out: list[int]
    chat_text: str
    chat_ids: list[int]
    chat_prompt_ids: list[int]


@dataclass
class Cluster:
    http_port: int
    grpc_port: int
    config: Any

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    def client(self, api_key: str | None = API_KEY, **kw: Any) -> KvrayClient:
        return KvrayClient(self.target, api_key, **kw)

    def stats(self) -> Any:
        from ray import serve

        return serve.get_deployment_handle("LLMServer", "kvray").stats.remote().result()


def rpc_status(call: Callable[[], Any]) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as err:
        call()
    return err.value.code(), err.value.details()


def wait_idle(cluster: Cluster) -> Any:
    return poll(
        lambda: (
            (s := cluster.stats()).num_requests_running == 0
            and s.num_requests_waiting == 0
            and s.kv_blocks_used == 0
            and s
        ),
        "the engine to be idle with every KV block free",
    )

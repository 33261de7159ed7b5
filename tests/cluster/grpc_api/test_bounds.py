"""Request bounds over gRPC end to end: the shared app's GrpcIngress (default bounds, an API
key) refuses what the HTTP API refuses, with INVALID_ARGUMENT naming the field where the
client wrote it and the ServeConfig limit."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import pytest

from cluster.grpc_api.client import KvrayClient
from cluster.ingress.limits import DEFAULT_LIMITS
from tests.cluster.serve_helpers import App, ServePorts

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def client(kvray_app: App, serve_ports: ServePorts) -> Iterator[KvrayClient]:
    # The shared app's GrpcIngress listens on Serve's gRPC port.
    with KvrayClient(f"127.0.0.1:{serve_ports.grpc}", kvray_app.api_key, timeout=120) as c:
        c.generate("warm up", max_tokens=1)  # waits until the gRPC ingress serves
        yield c


def _invalid(call: Callable[[], Any], path: str, setting: str) -> None:
    with pytest.raises(grpc.RpcError) as err:
        call()
    assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
    details = err.value.details()
    assert details.startswith(f"{path}: ") and setting in details, details


def test_n_and_stop_lists(client: KvrayClient) -> None:
    _invalid(
        lambda: client.generate("hi", max_tokens=1, n=DEFAULT_LIMITS.max_n + 1),
        "sampling.n",
        "max_n",
    )
    many = [f"s{i}" for i in range(DEFAULT_LIMITS.max_stop_strings + 1)]
    _invalid(
        lambda: client.generate("hi", max_tokens=1, stop=many), "sampling.stop", "max_stop_strings"
    )
    ids = list(range(DEFAULT_LIMITS.max_stop_token_ids + 1))
    _invalid(
        lambda: client.generate("hi", max_tokens=1, stop_token_ids=ids),
        "sampling.stop_token_ids",
        "max_stop_token_ids",
    )


def test_message_count(client: KvrayClient) -> None:
    messages = [{"role": "user", "content": "hi"}] * (DEFAULT_LIMITS.max_chat_messages + 1)
    _invalid(lambda: client.generate(messages=messages), "chat.messages", "max_chat_messages")


@pytest.mark.parametrize("field", ["temperature", "repetition_penalty", "top_p"])
def test_non_finite_floats(client: KvrayClient, field: str) -> None:
    _invalid(
        lambda: client.generate("hi", max_tokens=1, **{field: math.inf}),
        f"sampling.{field}",
        "finite",
    )


@pytest.mark.parametrize("field", ["top_p", "min_p", "temperature", "repetition_penalty"])
def test_denormal_floats_still_serve(client: KvrayClient, field: str) -> None:
    # Found by test_fuzz: 5e-324 is 0.0 in the engine's float32 tensors (see the HTTP test).
    reply = client.generate("hi", max_tokens=2, **{field: 5e-324})
    assert reply.completions[0].finish_reason != 0  # finished (stop or length)

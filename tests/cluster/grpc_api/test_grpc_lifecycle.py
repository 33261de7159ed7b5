"""The gRPC ingress's lifecycle end to end: health and reflection probes, draining, and calls
after the engine deployment is gone. The last two tests stop things (a drained gRPC ingress,
then the shared app of tests/cluster/grpc_api/conftest.py): tests/conftest.py runs this module
after the other gRPC modules, and they must stay last in it.
"""

from __future__ import annotations

from typing import Any

import grpc
import pytest

from cluster.config import ServeConfig
from cluster.grpc_api.client import KvrayClient
from kvray.v1 import llm_pb2
from tests.cluster.grpc_api.grpc_helpers import (
    PROMPTS,
    Cluster,
    health,
    poll,
    rpc_status,
    wait_serving,
)
from tests.cluster.serve_helpers import API_KEY, free_port

pytestmark = pytest.mark.slow


# -- probes ------------------------------------------------------------------------------------


def test_health_and_reflection(cluster: Cluster) -> None:
    from google.protobuf.descriptor_pool import DescriptorPool
    from grpc_health.v1 import health_pb2
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
        ProtoReflectionDescriptorDatabase,
    )

    # Probes carry no credentials: health and reflection answer without the key.
    assert health(cluster.grpc_port) == health_pb2.HealthCheckResponse.SERVING
    assert (
        health(cluster.grpc_port, "kvray.v1.LLMService") == health_pb2.HealthCheckResponse.SERVING
    )
    assert health(cluster.grpc_port, "no.such.Service") is None  # NOT_FOUND

    with grpc.insecure_channel(cluster.target) as ch:
        db = ProtoReflectionDescriptorDatabase(ch)
        services = set(db.get_services())
        assert {
            "kvray.v1.LLMService",
            "grpc.health.v1.Health",
            "grpc.reflection.v1alpha.ServerReflection",
        } <= services
        # What `grpcurl describe` does: resolve the service and its messages by reflection.
        service = DescriptorPool(db).FindServiceByName("kvray.v1.LLMService")
        stream = service.methods_by_name["GenerateStream"]
        assert stream.server_streaming and stream.input_type.full_name == "kvray.v1.GenerateRequest"


# -- lifecycle (these stop things: keep them last) ----------------------------------------------


def _extra_ingress(
    cluster: Cluster, name: str, config: ServeConfig | None = None, **settings: Any
) -> int:
    """Another GrpcIngress application on its own port, calling the main app's LLMServer."""
    from ray import serve

    from cluster.grpc_api.ingress import GrpcSettings, bind_grpc_ingress

    port = free_port()
    config = config or cluster.config
    llm = serve.get_deployment_handle("LLMServer", "kvray")
    opts = GrpcSettings.from_config(config, host="127.0.0.1", port=port, **settings)
    serve.run(bind_grpc_ingress(config, llm, opts), name=name, route_prefix=None)
    wait_serving(port)
    return port


def test_draining_is_not_serving_and_finishes_in_flight_calls(cluster: Cluster) -> None:
    from grpc_health.v1 import health_pb2
    from ray import serve

    port = _extra_ingress(cluster, "grpc-drain", drain_s=10.0, grace_s=60.0)
    with KvrayClient(f"127.0.0.1:{port}", API_KEY, timeout=600) as c:
        stream = c.generate_stream(PROMPTS[0], max_tokens=200, ignore_eos=True, temperature=0.0)
        pieces = [next(stream)]
        serve.delete("grpc-drain", _blocking=False)
        poll(
            lambda: health(port) == health_pb2.HealthCheckResponse.NOT_SERVING,
            "health NOT_SERVING while the ingress drains",
            interval=0.02,
        )
        # Still accepting while load balancers catch up, and the in-flight stream completes.
        assert c.generate(PROMPTS[1], max_tokens=2, temperature=0.0).usage.completion_tokens == 2
        pieces += list(stream)
    assert sum(len(c.token_ids) for p in pieces for c in p.completions) == 200
    assert pieces[-1].completions[-1].finish_reason == llm_pb2.FINISH_REASON_LENGTH


def test_no_engine_replica_is_unavailable(cluster: Cluster) -> None:
    from ray import serve

    # A request waits up to queue_timeout_s for a replica that can take it: a short one here.
    config = cluster.config.replace(queue_timeout_s=3.0)
    port = _extra_ingress(cluster, "grpc-orphan", config)
    serve.delete("kvray")  # the LLMServer deployment is gone for good
    with KvrayClient(f"127.0.0.1:{port}", API_KEY, timeout=120) as c:
        code, details = rpc_status(lambda: c.generate(PROMPTS[0], max_tokens=2))
        assert code is grpc.StatusCode.UNAVAILABLE, details
        assert (
            rpc_status(lambda: list(c.generate_stream(PROMPTS[0])))[0]
            is grpc.StatusCode.UNAVAILABLE
        )

"""What the router unit tests route with, without a Ray cluster.

The router itself, PendingRequest, ReplicaID and GenerateRequest are the real classes. Only
the replica is a stand-in: Ray's RunningReplica looks its actor up by name when built
(`RunningReplicaInfo.get_actor_handle`), which needs a running replica. `StubReplica` has
the part of RunningReplica's interface that request routers use (Ray's own router tests
use such a stand-in too).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field, replace
from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID

from cluster import ray_internals
from cluster.messages import GenerateRequest
from cluster.routing.kv_router import KvEventsRouter
from cluster.routing.router import PrefixAffinityRouter
from workers.inputs import InputChecker
from workers.lora.request import LoRARequest
from workers.sampling_params import SamplingParams

BLOCK_SIZE = 16
DEPLOYMENT = ray_internals.deployment_id("LLMServer", "kvray-test")


@dataclass
class StubReplica:
    """A RunningReplica's routing-facing interface: id, capacity, stats, queue length."""

    name: str
    max_ongoing_requests: int = 8
    routing_stats: dict[str, Any] = field(default_factory=dict)
    queue_len: int = 0  # what a queue-length probe answers

    @property
    def replica_id(self) -> ReplicaID:
        return ReplicaID(unique_id=self.name, deployment_id=DEPLOYMENT)

    async def get_queue_len(self, *, deadline_s: float) -> int:
        return self.queue_len


def replicas(n: int, **kwargs: Any) -> list[StubReplica]:
    return [StubReplica(f"r{i}", **kwargs) for i in range(n)]


def router(**kwargs: Any) -> PrefixAffinityRouter:
    """A PrefixAffinityRouter as Serve builds it, with request_router_kwargs `kwargs`."""
    r = ray_internals.standalone_router(PrefixAffinityRouter, "LLMServer", "kvray-test")
    r.initialize_state(**{"block_size": BLOCK_SIZE, **kwargs})
    return r


def kv_router(**kwargs: Any) -> KvEventsRouter:
    """A KvEventsRouter as Serve builds it, with request_router_kwargs `kwargs`."""
    r = ray_internals.standalone_router(KvEventsRouter, "LLMServer", "kvray-test")
    r.initialize_state(**{"block_size": BLOCK_SIZE, **kwargs})
    return r


def generate_request(
    prompt_token_ids: list[int],
    routing_key: str | None = None,
    request_id: str = "req",
    lora: int | None = None,
) -> GenerateRequest:
    """A checked request; `lora`: the id of the LoRA adapter it runs under (None: base)."""
    inp = InputChecker(vocab_size=4096, max_model_len=1024).check(
        prompt_token_ids, SamplingParams(max_tokens=2)
    )
    if lora is not None:
        inp = replace(inp, lora=LoRARequest(f"adapter-{lora}", lora, f"/adapters/{lora}"))
    return GenerateRequest(request_id=request_id, input=inp, routing_key=routing_key)


def pending(request: Any, internal_request_id: str = "ingress-request") -> PendingRequest:
    """A PendingRequest for `request` (call inside a running event loop: it holds a future).

    Every handle call made while serving one ingress request shares its internal request id,
    so tests give several the same one.
    """
    return PendingRequest(
        args=[request],
        kwargs={},
        metadata=ray_internals.request_metadata("req", internal_request_id),
        future=asyncio.get_running_loop().create_future(),
    )

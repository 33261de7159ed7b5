"""The multi-tenant workload under cache pressure (`--workload tenants-zipf`), and the
routers' CPU time per decision on it.

Each of `--num-tenants` tenants has a long system prompt (`--prefix-len` tokens); a request
is a tenant's system prompt plus its own question (`--input-len` tokens in all). Tenants
are drawn with Zipf popularity (P(tenant k) ~ 1 / k^s, `--zipf-s`): a few hot tenants and
a long tail, so with small KV caches (`--kv-cache-memory`) the tail's prefixes are evicted
and where each tenant is sent decides the hit rate.

`router_cpu_us` replays the workload's prompts through each router's decision in this
process (real router classes, stand-in replicas whose reports hold what an ideal
placement would), so the figure is the decision's own cost, without Serve's loop around it.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from cluster.bench.common.workload import BenchRequest, Workload


def zipf_tenant_workload(
    token_ids: Sequence[int],
    *,
    num_prompts: int,
    num_tenants: int,
    prefix_len: int,
    input_len: int,
    output_len: int,
    zipf_s: float,
    seed: int,
) -> Workload:
    """Tenants with their own system prompt (prefix_len tokens), drawn with Zipf popularity
    (zipf_s = 0: uniform); each request = its tenant's prefix + a random suffix, input_len
    tokens in all."""
    if num_tenants < 1 or not 0 < prefix_len < input_len or output_len < 1 or zipf_s < 0:
        raise ValueError(
            "need --num-tenants >= 1, 0 < --prefix-len < --input-len, --output-len >= 1, "
            "--zipf-s >= 0"
        )
    rng = random.Random(seed)
    prefixes = [tuple(rng.choices(token_ids, k=prefix_len)) for _ in range(num_tenants)]
    weights = [1.0 / (k + 1) ** zipf_s for k in range(num_tenants)]
    tenants = rng.choices(range(num_tenants), weights=weights, k=num_prompts)
    requests = tuple(
        BenchRequest(
            prefixes[t] + tuple(rng.choices(token_ids, k=input_len - prefix_len)), output_len
        )
        for t in tenants
    )
    params = {
        "num_tenants": num_tenants,
        "prefix_len": prefix_len,
        "input_len": input_len,
        "output_len": output_len,
        "zipf_s": zipf_s,
        "distinct_tenants_drawn": len(set(tenants)),
        "seed": seed,
    }
    return Workload("tenants-zipf", requests, params)


@dataclass
class _Replica:
    """What a request router reads of a replica (Ray's RunningReplica, minus the actor)."""

    name: str
    max_ongoing_requests: int = 64
    routing_stats: dict[str, Any] = field(default_factory=dict)

    @property
    def replica_id(self) -> Any:
        from ray.serve.request_router import ReplicaID

        from cluster.ray_internals import deployment_id

        return ReplicaID(unique_id=self.name, deployment_id=deployment_id("LLMServer", "bench"))

    async def get_queue_len(self, *, deadline_s: float) -> int:
        return 1


def router_cpu_us(workload: Workload, block_size: int, num_replicas: int) -> dict[str, float]:
    """Microseconds of CPU per routing decision, per router, over the workload's prompts."""
    return asyncio.run(_router_cpu_us(workload, block_size, num_replicas))


async def _router_cpu_us(
    workload: Workload, block_size: int, num_replicas: int
) -> dict[str, float]:
    from ray.serve.request_router import PendingRequest

    from cluster import ray_internals
    from cluster.messages import GenerateRequest
    from cluster.replica.kv_publish import KvPublisher
    from cluster.routing.kv_router import KvEventsRouter, prompt_block_hashes
    from cluster.routing.router import PrefixAffinityRouter
    from workers.core.kv_events import BlockStored
    from workers.inputs import InputChecker
    from workers.sampling_params import SamplingParams

    replicas = [_Replica(f"r{i}") for i in range(num_replicas)]
    # Each replica reports every prefix it would hold under an ideal placement.
    by_prefix: dict[tuple[int, ...], int] = {}
    for req in workload.requests:
        by_prefix.setdefault(req.prompt_ids[: workload.params["prefix_len"]], len(by_prefix))
    for i, rep in enumerate(replicas):
        pub = KvPublisher(epoch=rep.name)
        held = [
            h
            for prefix, t in by_prefix.items()
            if t % num_replicas == i
            for h in prompt_block_hashes(prefix, block_size, 256)
        ]
        pub.on_events((BlockStored(tuple(held), None, block_size),))
        rep.routing_stats = {"kv": pub.publish(), "running": 1, "waiting": 0}
    checker = InputChecker(vocab_size=1 << 31, max_model_len=1 << 20)
    params = SamplingParams(max_tokens=1)
    requests = [
        GenerateRequest(f"b{i}", checker.check(list(r.prompt_ids), params))
        for i, r in enumerate(workload.requests)
    ]
    out = {}
    for name, cls in (("prefix_affinity", PrefixAffinityRouter), ("kv_events", KvEventsRouter)):
        router = ray_internals.standalone_router(cls, "LLMServer", "bench")
        router.initialize_state(block_size=block_size)
        router.update_replicas(replicas)  # type: ignore[arg-type]
        loop = asyncio.get_running_loop()
        started = time.thread_time()
        for req in requests:
            pr = PendingRequest(
                args=[req],
                kwargs={},
                metadata=ray_internals.request_metadata(req.request_id),
                future=loop.create_future(),
            )
            await router.choose_replicas(replicas, pr)  # type: ignore[arg-type]
        out[name] = (time.thread_time() - started) / len(requests) * 1e6
    return out

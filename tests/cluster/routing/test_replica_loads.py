"""What auto's estimate reads from a deployment's router (cluster/routing/replica_loads.py):
each live replica's cached prompt tokens from the KV index, what a peer holds (with the
cluster tier), its load with the requests the stats do not show yet, its measured rates;
nothing before the handle has a router, or when the read races the router."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

from cluster.kv_priors import PRIOR_STEP_S
from cluster.replica.kv_publish import KvPublisher
from cluster.routing.replica_loads import replica_loads
from tests.cluster.routing.routing_kit import BLOCK_SIZE, generate_request, kv_router, replicas
from workers.core.block_hash import prompt_block_hashes
from workers.core.kv_events import BlockStored

PROMPT = list(range(100, 100 + 6 * BLOCK_SIZE + 5))


def _handle(router: Any) -> Any:
    """A DeploymentHandle's shape as far as the read goes (its router is Serve-private)."""
    return SimpleNamespace(_router=SimpleNamespace(_asyncio_router=SimpleNamespace(
        _request_router=router
    )))  # fmt: skip


def _kv(hashes: list[int]) -> dict:
    pub = KvPublisher(epoch="e")
    pub.on_events((BlockStored(tuple(hashes), None, BLOCK_SIZE),))
    return pub.publish()


def _routed(kv_share: bool) -> Any:
    """A KV router that knows three replicas (run inside an event loop: Serve's router
    probes new replicas' queues on it)."""
    return asyncio.run(_routed_in_loop(kv_share))


async def _routed_in_loop(kv_share: bool) -> Any:
    r = kv_router(kv_share=kv_share)
    reps = replicas(3)
    hashes = prompt_block_hashes(PROMPT, BLOCK_SIZE, 256)
    rates = {"prefill_tokens_per_s": 1500.0, "step_s": 0.0, "kv_bytes_per_token": 4096}
    reps[0].routing_stats = {"kv": _kv(hashes[:2]), "running": 3, "queued_tokens": 40}
    reps[1].routing_stats = {"kv": _kv(hashes[:5]), "waiting": 1, "kv_rates": rates}
    reps[2].routing_stats = {"engine_alive": False}  # passed over, as the router does
    r.update_replicas(reps)  # type: ignore[arg-type]
    r.refresh(reps)  # type: ignore[arg-type]
    r.replica_queue_len_cache.update(reps[0].replica_id, 5)  # 2 sent since its stats
    return r


def test_each_live_replica_as_its_router_sees_it() -> None:
    r = _routed(kv_share=False)
    loads = replica_loads(_handle(r), generate_request(PROMPT).input)
    assert loads is not None and len(loads) == 2
    first, second = sorted(loads, key=lambda x: x.cached_tokens)
    assert (first.cached_tokens, first.running, first.waiting) == (2 * BLOCK_SIZE, 3, 2)
    assert first.queued_tokens == 40 and first.pullable_tokens == 0
    assert (second.cached_tokens, second.waiting) == (5 * BLOCK_SIZE, 1)
    # Its measured rates; a figure not measured yet (0) keeps its prior.
    assert second.prefill_tokens_per_s == 1500.0 and second.kv_bytes_per_token == 4096
    assert second.step_s == PRIOR_STEP_S


def test_with_the_cluster_tier_a_replica_can_pull_what_a_peer_holds() -> None:
    r = _routed(kv_share=True)
    loads = replica_loads(_handle(r), generate_request(PROMPT).input)
    assert loads is not None
    assert sorted(x.pullable_tokens for x in loads) == [0, 3 * BLOCK_SIZE]


def test_an_adapters_blocks_are_not_the_base_models() -> None:
    r = _routed(kv_share=False)
    loads = replica_loads(_handle(r), generate_request(PROMPT, lora=7).input)
    assert loads is not None and all(x.cached_tokens == 0 for x in loads)


def test_nothing_before_the_handle_has_a_router_or_when_the_read_races() -> None:
    inp = generate_request(PROMPT).input
    assert replica_loads(SimpleNamespace(_router=None), inp) is None
    assert replica_loads(_handle(None), inp) is None

    class Racing:
        @property
        def curr_replicas(self) -> dict:
            raise RuntimeError("dictionary changed size during iteration")

    assert replica_loads(_handle(Racing()), inp) is None

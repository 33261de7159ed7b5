"""A request an inference gateway sent to one pod (`prefer_node_id`) goes to an engine replica
on that pod's node while one there can take it; otherwise the routers' own choice (a real
router, stub replicas with a node, no Ray cluster)."""

from __future__ import annotations

import asyncio
import dataclasses
from dataclasses import dataclass
from typing import Any

import pytest

from cluster.routing.router import rendezvous_rank, request_routing_key
from tests.cluster.routing.routing_kit import (
    StubReplica,
    generate_request,
    kv_router,
    pending,
    router,
)

PROMPT = list(range(64))  # four full blocks: a routing key


@dataclass
class NodeReplica(StubReplica):
    """A stub replica with RunningReplica's `node_id`."""

    node_id: str = ""


def _fleet() -> list[NodeReplica]:
    # Two nodes, two replicas each; every one idle.
    return [NodeReplica(f"r{i}", node_id=f"node-{i // 2}") for i in range(4)]


def _request(node: str | None, ids: list[int] = PROMPT, lora: int | None = None) -> Any:
    return dataclasses.replace(generate_request(ids, lora=lora), prefer_node_id=node)


def _choose(r: Any, candidates: list[NodeReplica], request: Any) -> list[list[str]]:
    async def go() -> list[list[str]]:
        ranks = await r.choose_replicas(candidates, pending(request))
        return [[rep.name for rep in rank] for rank in ranks]

    return asyncio.run(go())


def _flat(ranks: list[list[str]]) -> list[str]:
    return [name for rank in ranks for name in rank]


def _away_from_key(node_of: dict[str, str]) -> tuple[list[int], str]:
    """A prompt whose prefix-preferred replica is on node-1, and that node."""
    r = router()
    for start in range(0, 64_000, 64):
        ids = list(range(start, start + 64))
        key = request_routing_key(generate_request(ids), r._opts)
        assert key is not None
        first = rendezvous_rank(key, sorted(node_of))[0]
        if node_of[first] == "node-1":
            return ids, first
    raise AssertionError("no prompt found")


@pytest.mark.parametrize("make", [router, kv_router], ids=["prefix_affinity", "kv_events"])
def test_the_gateways_node_wins_over_the_routers_own_choice(make: Any) -> None:
    reps = _fleet()
    node_of = {r.name: r.node_id for r in reps}
    ids, elsewhere = _away_from_key(node_of)
    # Without a preference the prefix key sends it to node-1 (its rendezvous replica).
    assert _choose(make(), reps, _request(None, ids))[0] == [elsewhere]
    # The gateway chose node-0's pod: only node-0's replicas are ranked.
    ranked = _flat(_choose(make(), reps, _request("node-0", ids)))
    assert ranked and {node_of[n] for n in ranked} == {"node-0"}


def test_among_the_nodes_replicas_the_usual_rules_apply() -> None:
    reps = _fleet()
    reps[0].routing_stats = {"running": 3}
    # A short prompt (no key): the least loaded of node-0's replicas first.
    assert _choose(router(), reps, _request("node-0", list(range(8)))) == [["r1", "r0"]]


def test_a_node_at_its_max_ongoing_requests_falls_back_to_the_others() -> None:
    r = router()
    reps = _fleet()
    for rep in reps[:2]:  # node-0's replicas: as many in flight as they may hold
        r.replica_queue_len_cache.update(rep.replica_id, rep.max_ongoing_requests)
    # The router's own choice: node-1's idle replicas first (node-0's full ones at most last).
    first = _choose(r, reps, _request("node-0"))[0]
    assert first and {rep.node_id for rep in reps if rep.name in first} == {"node-1"}
    # One of them frees a slot: back to node-0, on that one.
    r.replica_queue_len_cache.update(reps[1].replica_id, reps[1].max_ongoing_requests - 1)
    assert _flat(_choose(r, reps, _request("node-0"))) == ["r1"]


def test_no_replica_there_or_no_preference_routes_as_before() -> None:
    reps = _fleet()
    for node in ("node-9", None, ""):  # a pod without an engine replica (or gone); none
        ranked = _flat(_choose(router(), reps, _request(node)))
        assert ranked and set(ranked) <= {r.name for r in reps}
    # Plain stub replicas (no node) are never asked for one without a preference.
    assert _flat(_choose(router(), [StubReplica("solo")], generate_request(PROMPT))) == ["solo"]


def test_dead_and_excluded_replicas_stay_out() -> None:
    reps = _fleet()
    reps[0].routing_stats = {"engine_alive": False}
    migrated = dataclasses.replace(_request("node-0"), exclude_replicas=frozenset({"r1"}))
    # node-0's live replica is r1, which the request failed on: another node's replica.
    ranked = _flat(_choose(router(), reps, migrated))
    assert ranked and set(ranked) <= {"r2", "r3"}


def test_a_lora_request_keeps_to_the_node_too() -> None:
    reps = _fleet()
    ranked = _flat(_choose(router(), reps, _request("node-1", lora=7)))
    assert ranked and set(ranked) <= {"r2", "r3"}

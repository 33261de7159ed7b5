"""Adapter-aware routing (cluster/routing/lora_policy.py) through the real prefix-affinity
router and stub replicas (no Ray cluster): holders first, then the adapter-salted prefix key,
then load; saturated holders spread the adapter; cold adapters go where every router sends
them; a burst follows its first placement before any report names it. Then live: two real
replicas serving four adapters through the OpenAI API."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from cluster.routing.lora_policy import (
    AdapterPlacements,
    AdapterRouting,
    adapter_key,
    rank_for_adapter,
)
from cluster.routing.router import RouterOptions, request_routing_key
from cluster.routing.router_keys import prefix_routing_key, rendezvous_rank
from tests.cluster.routing.routing_kit import (
    BLOCK_SIZE,
    StubReplica,
    generate_request,
    pending,
    replicas,
    router,
)
from tests.cluster.serve_helpers import (
    KV_CACHE_BYTES,
    App,
    ServePorts,
    deploy,
    openai_client,
    replica_stats,
)

OPTS = RouterOptions(block_size=BLOCK_SIZE)


class Recorder:
    """Stands in for RouterMetrics: the decisions the router counted."""

    def __init__(self) -> None:
        self.decisions: list[str] = []
        self.lora: list[str] = []

    def routing(self, decision: str) -> None:
        self.decisions.append(decision)

    def lora_routing(self, decision: str) -> None:
        self.lora.append(decision)


def _prompts(n: int, seed: int = 0, length: int = 64) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(5, 4000) for _ in range(length)] for _ in range(n)]


def _first(r: Any, reps: list[StubReplica], request: Any) -> tuple[list[list[str]], Any]:
    """(ranks as names, the pending request) of one choice."""

    async def go() -> tuple[list[list[str]], Any]:
        pr = pending(request)
        ranks = await r.choose_replicas(reps, pr)
        return [[x.name for x in rank] for rank in ranks], pr

    return asyncio.run(go())


def _route(r: Any, reps: list[StubReplica], request: Any, to: str | None = None) -> str:
    """Choose, then tell the router the request went to `to` (default: its first choice)."""

    async def go() -> str:
        pr = pending(request)
        ranks = await r.choose_replicas(reps, pr)
        name = to or ranks[0][0].name
        r.on_request_routed(pr, next(x for x in reps if x.name == name).replica_id, None)
        return name

    return asyncio.run(go())


def test_the_adapter_holder_wins_over_the_prefix() -> None:
    r = router()
    reps = replicas(3)
    reps[1].routing_stats = {"lora_adapters": (7,), "lora_slots_free": 0}
    reps[2].routing_stats = {"lora_adapters": (3, 4), "lora_slots_free": 0}
    homes = set()
    for prompt in _prompts(20):
        ranks, _ = _first(r, reps, generate_request(prompt, lora=7))
        assert ranks[0] == ["r1"]
        # Base-model requests of the same prompts keep their prefix's replica.
        homes.add(_first(r, reps, generate_request(prompt))[0][0][0])
    assert len(homes) > 1


def test_the_adapter_salted_prefix_key_picks_among_holders() -> None:
    r = router()
    reps = replicas(4)
    for rep in reps:
        rep.routing_stats = {"lora_adapters": (1, 2)}
    names = [x.name for x in reps]
    differ = 0
    for prompt in _prompts(30, seed=1):
        keys = {s: prefix_routing_key(prompt, BLOCK_SIZE, 4, salt=s) for s in (None, 1, 2)}
        assert len(set(keys.values())) == 3  # a prefix under one adapter is not another's
        assert request_routing_key(generate_request(prompt, lora=1), OPTS) == keys[1]
        picks = {}
        for lora in (1, 2):
            ranks, _ = _first(r, reps, generate_request(prompt, lora=lora))
            picks[lora] = ranks[0][0]
            assert picks[lora] == rendezvous_rank(keys[lora], names)[0]  # type: ignore[arg-type]
        differ += picks[1] != picks[2]
    assert differ > 0
    # Shorter than a block: the least loaded holder.
    reps[2].routing_stats["running"] = 0
    for i in (0, 1, 3):
        reps[i].routing_stats["running"] = 2
    assert _first(r, reps, generate_request([1, 2, 3], lora=1))[0][0] == ["r2"]


def test_saturated_holders_spread_the_adapter_to_a_free_slot() -> None:
    r = router()
    reps = replicas(3)
    r._metrics = rec = Recorder()
    reps[0].routing_stats = {"lora_adapters": (5,), "lora_slots_free": 1, "waiting": 2}
    reps[1].routing_stats = {"lora_adapters": (8, 9), "lora_slots_free": 0}
    reps[2].routing_stats = {"lora_adapters": (), "lora_slots_free": 2}
    prompt = _prompts(1, seed=2)[0]
    ranks, _ = _first(r, reps, generate_request(prompt, lora=5))
    # The holder is queueing: to the replica with a free slot; the holder next, then the rest.
    assert ranks == [["r2"], ["r0", "r1"]]
    assert _route(r, reps, generate_request(prompt, lora=5)) == "r2"
    assert rec.lora == ["spread"]
    # Far busier than the least loaded (the imbalance rule) is saturated too.
    reps[0].routing_stats = {"lora_adapters": (5,), "lora_slots_free": 1}
    r2 = router()
    r2.replica_queue_len_cache.update(reps[0].replica_id, 4)
    assert _first(r2, reps, generate_request(prompt, lora=5))[0][0] == ["r2"]
    r2.replica_queue_len_cache.update(reps[0].replica_id, 3)
    assert _first(r2, reps, generate_request(prompt, lora=5))[0][0] == ["r0"]


def test_a_cold_adapter_goes_to_its_own_replica_first_with_a_free_slot() -> None:
    reps = replicas(4)
    for rep in reps:
        rep.routing_stats = {"lora_adapters": (), "lora_slots_free": 1}
    names = [x.name for x in reps]
    homes = set()
    for lora in range(1, 30):
        home = rendezvous_rank(adapter_key(lora), names)[0]  # type: ignore[arg-type]
        homes.add(home)
        # Every prompt of it, from any router, goes to its home.
        for prompt in _prompts(3, seed=lora):
            assert _first(router(), reps, generate_request(prompt, lora=lora))[0][0] == [home]
    assert homes == set(names)
    # Its home has no free slot (a load there would evict): the next one in its order.
    order = rendezvous_rank(adapter_key(1), names)  # type: ignore[arg-type]
    next(x for x in reps if x.name == order[0]).routing_stats["lora_slots_free"] = 0
    assert _first(router(), reps, generate_request(_prompts(1)[0], lora=1))[0][0] == [order[1]]


def test_a_burst_follows_its_first_placement_until_reports_catch_up() -> None:
    r = router()
    reps = replicas(3)
    r._metrics = rec = Recorder()
    prompts = _prompts(10, seed=4)
    # Nothing reported yet: the first request is sent (by Serve) to r1, whoever ranked first.
    _route(r, reps, generate_request(prompts[0], lora=9), to="r1")
    for prompt in prompts[1:]:
        assert _route(r, reps, generate_request(prompt, lora=9)) == "r1"
    assert rec.lora == ["cold"] + ["held"] * 9
    # Base-model requests are not adapter choices.
    _route(r, reps, generate_request(prompts[0]))
    assert len(rec.lora) == 10


def test_placements_expire_and_are_bounded() -> None:
    p = AdapterPlacements(hold_s=5.0, max_adapters=2)
    p.sent(1, "r0", now=100.0)
    assert p.recent(1, now=104.0) == {"r0"}
    assert p.recent(1, now=105.0) == set()
    p.sent(1, "r0", now=100.0)
    p.sent(2, "r1", now=100.0)
    p.sent(3, "r2", now=100.0)  # the oldest adapter goes
    assert p.recent(1, now=101.0) == set() and p.recent(3, now=101.0) == {"r2"}


def test_every_replica_saturated_keeps_the_request_on_a_holder() -> None:
    reps = replicas(3)
    for rep, running in zip(reps, (6, 3, 1), strict=True):
        rep.routing_stats = {"waiting": 1, "running": running}
    reps[0].routing_stats["lora_adapters"] = (4,)
    reps[1].routing_stats["lora_adapters"] = (4,)
    by_load = sorted(reps, key=lambda x: x.routing_stats["running"])
    ranked, decision = rank_for_adapter(by_load, 4, "k", {"r0", "r1"}, lambda _: True)
    assert [x.name for x in ranked] == ["r1", "r0", "r2"] and decision == "held"
    ranked, decision = rank_for_adapter(by_load, 5, "k", set(), lambda _: True)
    assert ranked[0].name == "r2" and decision == "cold"


def test_routed_labels() -> None:
    routing = AdapterRouting()
    a, b, c = object(), object(), object()
    routing.chosen(a, 1, {"r0"}, first="r0", keyed=True)
    routing.chosen(b, 1, {"r0"}, first="r0", keyed=False)
    routing.chosen(c, 2, set(), first="r1", keyed=True)
    assert routing.routed(a, "r0", 0.0) == ("affinity", "held")
    assert routing.routed(b, "r2", 0.0) == ("fallback", "spread")
    assert routing.routed(c, "r1", 0.0) == ("affinity", "cold")
    assert routing.routed(c, "r1", 0.0) is None  # counted once
    assert routing.holders(replicas(3), 1, now=1.0) == {"r0", "r2"}


def test_slots_this_router_just_filled_count_as_taken() -> None:
    """Reports lag: two cold adapters whose home has one free slot left do not both go there."""
    r = router()
    reps = replicas(2)
    for rep in reps:
        rep.routing_stats = {"lora_adapters": (), "lora_slots_free": 1}
    names = [x.name for x in reps]
    homes = {i: rendezvous_rank(adapter_key(i), names)[0] for i in range(1, 40)}  # type: ignore[arg-type]
    first, second = [i for i in homes if homes[i] == "r0"][:2]
    assert _route(r, reps, generate_request(_prompts(1)[0], lora=first)) == "r0"
    assert _route(r, reps, generate_request(_prompts(1)[0], lora=second)) == "r1"
    # Once r0 reports the first adapter in its slot (and no slot free), nothing is counted twice.
    reps[0].routing_stats = {"lora_adapters": (first,), "lora_slots_free": 0}
    assert r._adapters.free_slots(reps[0], now=0.0) == 0


# -- live: two replicas, four adapters, two slots each -----------------------------------------

ADAPTERS = tuple(f"ad-{i}" for i in range(4))


@pytest.fixture(scope="module")
def lora_app(
    serve_ports: ServePorts, demo_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[App]:
    from ray import serve

    from cluster.bench.serve.random_lora import write_random_adapters
    from cluster.config import ServeConfig

    paths = write_random_adapters(demo_dir, tmp_path_factory.mktemp("adapters"), list(ADAPTERS), 4)
    config = ServeConfig.from_flat(
        num_replicas=2,
        kv_cache_memory_bytes=KV_CACHE_BYTES,
        max_num_seqs=16,
        lora_modules=tuple(f"{n}={p}" for n, p in paths.items()),
        max_loras=2,
        max_lora_rank=4,
    )
    app = deploy("kvray-lora-routing", "/lora-routing", config, serve_ports, None)
    yield app
    serve.delete(app.name)


@pytest.mark.slow
def test_each_adapter_is_loaded_once_and_its_prefix_serves_only_it(lora_app: App) -> None:
    client = openai_client(lora_app)
    rng = random.Random(5)

    def complete(model: str, prompt: list[int]) -> Any:
        return client.completions.create(
            model=model, prompt=prompt, max_tokens=2, temperature=0, extra_body={"ignore_eos": True}
        )

    # Three requests per adapter, each its own prompt: prefix alone would scatter them.
    for name in ADAPTERS:
        for _ in range(3):
            complete(name, [rng.randrange(100, 3000) for _ in range(40)])
    stats = replica_stats(lora_app, 2)
    print({r: (s["lora_adapters"], s["lora_loads"], s["lora_evictions"]) for r, s in stats.items()})
    # Every adapter was loaded once, on one replica: its later requests followed it.
    assert sum(s["lora_loads"] for s in stats.values()) == len(ADAPTERS)
    # What the routers learn it from: each replica's routing stats name its adapters.
    free = {
        tuple(sorted(s["lora_adapters"])): s["lora_slots_total"] - s["lora_slots_used"]
        for s in stats.values()
    }
    for _ in range(6):
        report = lora_app.handle().record_routing_stats.remote().result()
        assert free[tuple(sorted(report["lora_adapters"]))] == report["lora_slots_free"]

    # A prefix computed under one adapter serves that adapter only (the engine salts its block
    # hashes, the router its key): 3 full blocks of 16 tokens, plus the token always computed.
    shared = [rng.randrange(100, 3000) for _ in range(48)] + [7]
    complete(ADAPTERS[0], shared)
    cached = {m: complete(m, shared).usage.prompt_tokens_details.cached_tokens for m in ADAPTERS}
    base = complete(lora_app.model, shared).usage.prompt_tokens_details.cached_tokens
    assert cached[ADAPTERS[0]] == 48
    assert set(cached.values()) - {48} == {0} and base == 0

"""The prefix-affinity router: keys, rendezvous hashing, the decision rules (no Ray cluster),
and prefix-cache hits vs power-of-two (real Ray)."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Iterator
from typing import Any

import pytest

from cluster.routing.kv_router import prompt_block_hashes
from cluster.routing.router import (
    RouterOptions,
    live_replicas,
    prefix_routing_key,
    rendezvous_rank,
    request_routing_key,
)
from tests.cluster.routing.routing_kit import (
    BLOCK_SIZE,
    StubReplica,
    generate_request,
    kv_router,
    pending,
    replicas,
    router,
)
from tests.cluster.serve_helpers import KV_CACHE_BYTES, App, ServePorts, deploy, openai_client

OPTS = RouterOptions(block_size=BLOCK_SIZE)


def _key(ids: list[int]) -> str | None:
    return prefix_routing_key(ids, BLOCK_SIZE, max_blocks=4)


def test_key_is_the_first_full_blocks() -> None:
    ids = list(range(1000, 1100))
    assert _key(ids[:15]) is None  # no full block: route by load
    assert _key(ids[:16]) is not None
    # Only the first max_blocks blocks count: a shared 64-token prefix is one key.
    assert _key(ids[:64] + [1, 2, 3] * 10) == _key(ids[:64] + [9] * 40)
    changed = ids.copy()
    changed[3] = 7
    assert _key(changed) != _key(ids)
    # A partial block after the full ones does not change the key.
    assert _key(ids[:40]) == _key(ids[:32] + [5] * 8)
    # The block size is the engine's: 8-token blocks make 8 tokens a key.
    assert prefix_routing_key(ids[:8], 8, 4) is not None


def test_request_keys() -> None:
    ids = list(range(64))
    explicit = generate_request([1] * 64, routing_key="tenant-7")
    assert request_routing_key(explicit, OPTS) == "tenant-7"
    assert request_routing_key(generate_request(ids), OPTS) == _key(ids)
    assert request_routing_key(generate_request(ids[:15]), OPTS) is None  # under a block
    # replica_stats({"routing_key": K}) calls: the explicit key only.
    assert request_routing_key({"routing_key": "stats-3"}, OPTS) == "stats-3"
    assert request_routing_key({"routing_key": ""}, OPTS) is None
    assert request_routing_key({}, OPTS) is None
    assert request_routing_key([1, 2, 3], OPTS) is None  # not a request the router knows
    assert request_routing_key(None, OPTS) is None


def test_options_come_from_the_router_kwargs() -> None:
    r = router(max_blocks=2)
    assert r._opts == RouterOptions(block_size=BLOCK_SIZE, max_blocks=2)
    with pytest.raises(ValueError, match="block_size"):
        router().initialize_state()  # Serve passes no kwargs: app.py forgot the block size
    with pytest.raises(ValueError, match="text_prefix_chars"):
        router(text_prefix_chars=256)


def test_rendezvous_is_stable_and_consistent() -> None:
    replicas = [f"r{i}" for i in range(5)]
    rng = random.Random(0)
    keys = [f"{rng.getrandbits(64):x}" for _ in range(400)]
    first = {k: rendezvous_rank(k, replicas)[0] for k in keys}
    # Independent of the order the replicas are listed in (every router agrees).
    shuffled = replicas[::-1]
    assert all(rendezvous_rank(k, shuffled)[0] == first[k] for k in keys)
    # Spreads keys over every replica.
    assert set(first.values()) == set(replicas)
    # Removing a replica moves only the keys it owned.
    fewer = [r for r in replicas if r != "r2"]
    for k in keys:
        if first[k] != "r2":
            assert rendezvous_rank(k, fewer)[0] == first[k]


# -- decision rules (a real router, stub replicas, no Ray cluster) ---------------------------


def _saturated(preferred: StubReplica, least: StubReplica | None = None, **opts: Any) -> bool:
    return router(**opts)._saturated(preferred, least or StubReplica("idle"))  # type: ignore[arg-type]


def test_fallback_rule() -> None:
    assert not _saturated(StubReplica("p"))
    # The engine is queueing.
    assert _saturated(StubReplica("p", routing_stats={"waiting": 1}))
    # Half way to rejecting with 429 (the replica's own waiting-queue cap).
    half = {"max_queued_requests": 10}
    assert not _saturated(StubReplica("p", routing_stats={**half, "queued": 4}))
    assert _saturated(StubReplica("p", routing_stats={**half, "queued": 5}))
    assert not _saturated(StubReplica("p", routing_stats={"queued": 50}))  # no cap: no rule
    # ... and half way to its cap on waiting prompt tokens.
    tokens = {"max_queued_tokens": 1000}
    assert not _saturated(StubReplica("p", routing_stats={**tokens, "queued_tokens": 499}))
    assert _saturated(StubReplica("p", routing_stats={**tokens, "queued_tokens": 500}))
    # KV cache nearly full, at the configured limit.
    assert not _saturated(StubReplica("p", routing_stats={"kv_cache_usage": 0.94}))
    assert _saturated(StubReplica("p", routing_stats={"kv_cache_usage": 0.95}))
    assert not _saturated(
        StubReplica("p", routing_stats={"kv_cache_usage": 0.95}), kv_cache_usage_limit=0.99
    )
    # In flight (routing stats while the queue-length cache is cold) at max_ongoing_requests.
    full = StubReplica("p", max_ongoing_requests=4, routing_stats={"running": 4})
    assert _saturated(full, least=StubReplica("q", routing_stats={"running": 4}))
    # Far busier than the least loaded one: imbalance_threshold (4) or more in flight apart.
    busy = StubReplica("p", max_ongoing_requests=100, routing_stats={"running": 6})
    assert not _saturated(busy, least=StubReplica("q", routing_stats={"running": 3}))
    assert _saturated(busy, least=StubReplica("q", routing_stats={"running": 2}))
    assert not _saturated(
        busy, least=StubReplica("q", routing_stats={"running": 2}), imbalance_threshold=5
    )


def test_in_flight_prefers_the_queue_length_cache() -> None:
    r = router()
    p = StubReplica("p", max_ongoing_requests=4, routing_stats={"running": 0})
    r.replica_queue_len_cache.update(p.replica_id, 4)  # what this router sent it
    assert r._in_flight(p) == 4
    assert r._saturated(p, StubReplica("q"))  # type: ignore[arg-type]


def _choose(r: Any, candidates: list[StubReplica], request: Any) -> list[list[str]]:
    async def go() -> list[list[str]]:
        pr = pending(request)
        ranks = await r.choose_replicas(candidates, pr)
        # Serve backs off between rounds that found no room (no spinning), once it has any.
        assert pr.routing_context.should_backoff == bool(candidates)
        return [[rep.name for rep in rank] for rank in ranks]

    return asyncio.run(go())


def _preferred_name(key: str, candidates: list[StubReplica]) -> str:
    return rendezvous_rank(key, [c.name for c in candidates])[0]


def test_choose_replicas_keyed() -> None:
    r = router()
    reps = replicas(4)
    reps[0].routing_stats = {"running": 1}
    reps[1].routing_stats = {"running": 2}
    reps[2].routing_stats = {"running": 3}
    reps[3].routing_stats = {"running": 0}
    request = generate_request(list(range(64)), routing_key="tenant-1")
    preferred = _preferred_name("tenant-1", reps)
    others = [n for n in ("r3", "r0", "r1", "r2") if n != preferred][:2]
    # Not saturated: the preferred replica first, then the two least loaded others.
    assert _choose(r, reps, request) == [[preferred], others]
    # Saturated (its engine is queueing): the two least loaded others first, it last.
    next(c for c in reps if c.name == preferred).routing_stats["waiting"] = 1
    assert _choose(r, reps, request) == [others, [preferred]]
    # A stats call keyed to it still reaches it: that is how a caller sees a busy replica.
    assert _choose(r, reps, {"routing_key": "tenant-1"}) == [[preferred]]
    # A single saturated replica still gets the request.
    only = [StubReplica("solo", routing_stats={"waiting": 3})]
    assert _choose(r, only, request) == [["solo"]]
    assert _choose(r, [], request) == []


def test_choose_replicas_unkeyed() -> None:
    r = router()
    reps = replicas(3)
    for rep, running in zip(reps, (5, 1, 3), strict=True):
        rep.routing_stats = {"running": running}
    # Shorter than a block: the two least loaded, one rank (Serve picks within it).
    assert _choose(r, reps, generate_request(list(range(10)))) == [["r1", "r2"]]
    # Equal in-flight counts: KV usage breaks the tie.
    reps[0].routing_stats = {"running": 1, "kv_cache_usage": 0.5}
    reps[1].routing_stats = {"running": 1, "kv_cache_usage": 0.1}
    assert _choose(r, reps, {"no": "key"}) == [["r1", "r0"]]


def test_dead_engines_get_no_requests_while_another_lives() -> None:
    r = router()
    reps = replicas(3)
    # The dead one fails requests fast, so it looks the least loaded of all.
    reps[0].routing_stats = {"running": 0, "engine_alive": False}
    reps[1].routing_stats = {"running": 4, "engine_alive": True}
    reps[2].routing_stats = {"running": 2}  # no flag yet (first stats pending): alive
    assert _choose(r, reps, generate_request(list(range(10)))) == [["r2", "r1"]]
    # Keyed to the dead replica: the key's next live replica is preferred instead.
    key = next(f"k{i}" for i in range(1000) if _preferred_name(f"k{i}", reps) == "r0")
    ranks = _choose(r, reps, generate_request(list(range(64)), routing_key=key))
    assert "r0" not in sum(ranks, [])
    assert ranks[0] == [_preferred_name(key, reps[1:])]
    # Every engine dead: keep them all, so requests fail fast with the engine-dead error.
    for rep in reps:
        rep.routing_stats = {"running": 0, "engine_alive": False}
    assert _choose(r, reps, generate_request(list(range(64)), routing_key=key))[0] == ["r0"]
    assert live_replicas(reps) == reps  # type: ignore[arg-type]


@pytest.mark.parametrize("kind", ["prefix_affinity", "kv_events"])
def test_a_replica_at_its_queue_cap_gets_nothing_while_another_has_room(kind: str) -> None:
    """The stats (up to a period old) show no queue; this router's own in-flight counts, less
    what the engines ran, show r0 at its cap of 8 waiting: it would answer 429."""
    r = router() if kind == "prefix_affinity" else kv_router()
    reps = replicas(2, max_ongoing_requests=256)
    for rep in reps:
        rep.routing_stats = {"running": 32, "queued": 0, "max_queued_requests": 8}
    key = next(f"k{i}" for i in range(1000) if _preferred_name(f"k{i}", reps) == "r0")
    keyed = generate_request(list(range(64)), routing_key=key)
    held = generate_request(list(range(64)))
    if kind == "kv_events":  # r0 was just sent its prefix: the cheaper one, but full
        r.index.predict(
            "r0", prompt_block_hashes(list(range(64)), BLOCK_SIZE, 256), time.monotonic()
        )
    r.replica_queue_len_cache.update(reps[0].replica_id, 40)  # 32 run, 8 wait: full
    r.replica_queue_len_cache.update(reps[1].replica_id, 39)  # 7 wait: room for one
    for request in (keyed, held, generate_request(list(range(10)))):
        assert _choose(r, reps, request) == [["r1"]]
    # Both at the cap: both stay candidates (Serve's queue holds the request, or r0 refuses).
    r.replica_queue_len_cache.update(reps[1].replica_id, 40)
    assert sorted(sum(_choose(r, reps, keyed), [])) == ["r0", "r1"]


def test_routing_decision_labels() -> None:
    async def go() -> None:
        r = router()
        reps = replicas(3)
        r.update_replicas(reps)  # type: ignore[arg-type]
        keyed = pending(generate_request(list(range(64))))
        key = request_routing_key(keyed.args[0], OPTS)
        assert key is not None
        preferred = _preferred_name(key, reps)
        other = next(c for c in reps if c.name != preferred)
        by_name = {c.name: c.replica_id for c in reps}
        assert r.routing_decision(keyed, by_name[preferred]) == "affinity"
        assert r.routing_decision(keyed, other.replica_id) == "fallback"
        unkeyed = pending(generate_request([1, 2, 3]))
        assert r.routing_decision(unkeyed, other.replica_id) == "load"

        # on_request_routed counts the label.
        seen: list[str] = []

        class Recorder:
            def routing(self, decision: str) -> None:
                seen.append(decision)

        r._metrics = Recorder()
        r.on_request_routed(keyed, by_name[preferred], None)
        r.on_request_routed(keyed, other.replica_id, None)
        r.on_request_routed(unkeyed, other.replica_id, None)
        assert seen == ["affinity", "fallback", "load"]

    asyncio.run(go())


# -- prefix-cache hits against Serve's default router (real Ray, 2 replicas each) -------------


@pytest.fixture(scope="module")
def pow2_app(serve_ports: ServePorts) -> Iterator[App]:
    from ray import serve

    from cluster.config import ServeConfig

    config = ServeConfig.from_flat(
        num_replicas=2,
        request_router="power_of_two",
        kv_cache_memory_bytes=KV_CACHE_BYTES,
        max_num_seqs=32,
    )
    app = deploy("kvray-pow2", "/pow2", config, serve_ports, None)
    yield app
    serve.delete(app.name)


def _tenant_workload(seed: int) -> list[list[int]]:
    """4 tenants x 6 requests: a 64-token tenant prefix + a 16-token unique suffix each."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(100, 3000) for _ in range(64)] for _ in range(4)]
    order = [t for _ in range(6) for t in range(4)]
    return [prefixes[t] + [rng.randrange(100, 3000) for _ in range(16)] for t in order]


def _cached_tokens(app: App, prompts: list[list[int]]) -> int:
    client = openai_client(app)
    total = 0
    for prompt in prompts:  # one at a time: a cache entry exists once its prefill is done
        r = client.completions.create(
            model=app.model,
            prompt=prompt,
            max_tokens=2,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        total += r.usage.prompt_tokens_details.cached_tokens
    return total


@pytest.mark.slow
def test_affinity_gets_at_least_the_cache_hits_of_power_of_two(
    kvray_app: App, pow2_app: App
) -> None:
    # Fresh random prefixes for each app, so neither finds the other's work cached.
    affinity: Any = _cached_tokens(kvray_app, _tenant_workload(seed=1))
    pow2: Any = _cached_tokens(pow2_app, _tenant_workload(seed=2))
    print(f"prefix-cache hits (tokens): affinity {affinity}, power-of-two {pow2}")
    # With affinity each tenant's first request misses and the other 5 hit 64 tokens each.
    assert affinity == 4 * 5 * 64
    assert affinity >= pow2

"""The KV-event router on real Ray: two replicas hold different prefixes (placed there with
explicit routing keys), and requests without a key go to the replica holding theirs, as the
replicas' own prefix-cache hits show. After a replica is killed and replaced, the router's
index holds nothing of it."""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from typing import Any

import pytest

from cluster.replica.kv_publish import SNAPSHOT_EVERY
from cluster.routing.kv_router import prompt_block_hashes
from cluster.routing.router import ROUTING_STATS_PERIOD_S
from tests.cluster.serve_helpers import KV_CACHE_BYTES, App, ServePorts, deploy, replica_stats
from workers.config import DEFAULT_BLOCK_SIZE
from workers.inputs import InputChecker
from workers.sampling_params import SamplingParams

PREFIX_TOKENS = 96


@pytest.fixture(scope="module")
def kv_app(serve_ports: ServePorts) -> Iterator[App]:
    from ray import serve

    from cluster.config import ServeConfig

    config = ServeConfig.from_flat(
        num_replicas=2,
        request_router="kv_events",
        kv_cache_memory_bytes=KV_CACHE_BYTES,
        max_num_seqs=16,
    )
    app = deploy("kvray-kvev", "/kvev", config, serve_ports, None)
    yield app
    serve.delete(app.name)


def _generate(app: App, ids: list[int], key: str | None = None) -> None:
    from cluster.messages import GenerateRequest

    inp = InputChecker(vocab_size=4096, max_model_len=1024).check(
        ids, SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    )
    req = GenerateRequest(request_id=f"kv-{random.random()}", input=inp, routing_key=key)
    for _ in app.handle().options(stream=True).generate.remote(req):
        pass


def _hits(app: App) -> dict[str, int]:
    return {rid: s["prefix_cache_hits"] for rid, s in replica_stats(app, 2).items()}


def _keys_by_replica(app: App) -> dict[str, str]:
    """An explicit routing key that reaches each replica."""
    handle = app.handle()
    keys: dict[str, str] = {}
    for i in range(64):
        rid = handle.replica_stats.remote({"routing_key": f"kv-{i}"}).result()["replica"]
        keys.setdefault(rid, f"kv-{i}")
        if len(keys) == 2:
            return keys
    raise AssertionError(f"routing keys reached only {list(keys)}")


def _wait_for_reports(app: App, placed: dict[str, list[int]]) -> None:
    """Until this process's router has the engines' reports of each replica's prefix and sees
    every replica idle (a hang guard: a router resyncs from a snapshot within SNAPSHOT_EVERY
    routing-stats periods). Idle matters: the report that carries a prefix can be taken while
    its request still ran, and a replica whose queue length Serve no longer caches (10 s)
    is judged by that report; one request in flight outweighs a 96-token hit."""
    router = _router(app)
    deadline = time.monotonic() + 60 + SNAPSHOT_EVERY * ROUTING_STATS_PERIOD_S
    while True:
        router.refresh([])  # what routing a request does first
        reported = {rid: set(rep.blocks) for rid, rep in router.index.replicas.items()}
        load = _loads(router)
        if all(
            set(prompt_block_hashes(ids, DEFAULT_BLOCK_SIZE, 256)) <= reported.get(rid, set())
            for rid, ids in placed.items()
        ) and all(v == (0, 0) for v in load.values()):
            return
        assert time.monotonic() < deadline, f"no reports of {placed} or not idle: {load}"
        time.sleep(ROUTING_STATS_PERIOD_S / 2)


def _loads(router: Any) -> dict[str, tuple[float, int]]:
    """Per replica: the router's own cost of an empty prompt (its load term alone, from
    Serve's cached queue length while it has one), and the running + waiting requests of
    the replica's last routing-stats report (what the router falls back on once Serve's
    cache entry expires). Idle is (0, 0): a report taken while a placing request still ran
    would otherwise surface later as one request in flight, outweighing a 96-token hit."""
    out = {}
    for r in router.curr_replicas.values():
        stats = r.routing_stats or {}
        reported = int(stats.get("running", 0)) + int(stats.get("waiting", 0))
        out[r.replica_id.unique_id] = (router.cost(r, 0, 0), reported)
    return out


def _router(app: App) -> Any:
    from cluster.ray_internals import handle_request_router

    return handle_request_router(app.handle())


@pytest.mark.slow
def test_requests_go_to_the_replica_holding_their_prefix(kv_app: App) -> None:
    import ray

    from cluster.ray_internals import replica_actor

    rng = random.Random(17)
    prefixes = [[rng.randrange(100, 3000) for _ in range(PREFIX_TOKENS)] for _ in range(2)]
    keys = _keys_by_replica(kv_app)
    owners = list(keys)  # prefixes[i] is placed on owners[i]
    for prefix, rid in zip(prefixes, owners, strict=True):
        _generate(kv_app, prefix + [7], keys[rid])
    # Before the wait for idle replicas, not after: the stats calls go through the router too,
    # and Serve caches the queue length each reported (one call in flight) for seconds after;
    # taken last, that made a prefix's owner look busy to the first request of the rounds.
    before = _hits(kv_app)
    _wait_for_reports(kv_app, {rid: p + [7] for p, rid in zip(prefixes, owners, strict=True)})

    router = _router(kv_app)
    seen = []  # the router's view before each request: a failure says what it routed on
    rounds = 4
    for _ in range(rounds):
        for i, prefix in enumerate(prefixes):  # no key: the router decides from the reports
            ids = prefix + [rng.randrange(100, 3000) for _ in range(8)]
            hashes = prompt_block_hashes(ids, DEFAULT_BLOCK_SIZE, 256)
            held = {rid: router.index.overlap(rid, hashes, time.monotonic()) for rid in owners}
            seen.append((i, held, _loads(router)))
            _generate(kv_app, ids)
    after = _hits(kv_app)
    gained = {rid: after[rid] - before.get(rid, 0) for rid in after}
    print(f"prefix-cache hits gained per replica: {gained}")
    for rid in owners:
        # Every request of its prefix hit the whole prefix there (96 tokens: 6 whole blocks).
        assert gained[rid] == rounds * PREFIX_TOKENS, (gained, owners, seen)

    # Kill the first prefix's replica: Serve replaces it, and the router forgets it at once.
    assert owners[0] in router.index.replicas
    ray.kill(replica_actor(kv_app.name, "LLMServer", owners[0]), no_restart=True)
    deadline = time.monotonic() + 120
    while True:  # hang guard: a replacement replica starts within seconds here
        stats = replica_stats(kv_app, 2)
        if len(stats) == 2 and owners[0] not in stats:
            break
        assert time.monotonic() < deadline, f"no replacement replica: {list(stats)}"
        time.sleep(1.0)
    new = next(rid for rid in stats if rid not in owners)
    _generate(kv_app, prefixes[1] + [5, 6, 7])  # any routed request refreshes the index
    assert owners[0] not in router.index.replicas
    assert set(router.index.replicas) <= {owners[1], new}
    gone = set(prompt_block_hashes(prefixes[0] + [1], DEFAULT_BLOCK_SIZE, 256))
    for rid, rep in list(router.index.replicas.items()):
        assert not gone & set(rep.blocks), f"{rid} still listed with the dead replica's prefix"

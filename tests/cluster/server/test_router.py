"""The prefix-affinity router: keys, rendezvous hashing, and prefix-cache hits vs power-of-two."""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import pytest

from cluster.server.router import (
    DEFAULTS,
    prefix_routing_key,
    rendezvous_rank,
    request_routing_key,
)
from tests.cluster.serve_helpers import KV_CACHE_BYTES, App, ServePorts, deploy, openai_client


def test_key_is_the_first_full_blocks() -> None:
    ids = list(range(1000, 1100))
    assert prefix_routing_key(ids[:15]) is None  # no full block: route by load
    assert prefix_routing_key(ids[:16]) is not None
    # Only the first max_blocks blocks count: a shared 64-token prefix is one key.
    assert prefix_routing_key(ids[:64] + [1, 2, 3] * 10) == prefix_routing_key(ids[:64] + [9] * 40)
    changed = ids.copy()
    changed[3] = 7
    assert prefix_routing_key(changed) != prefix_routing_key(ids)
    # A partial block after the full ones does not change the key.
    assert prefix_routing_key(ids[:40]) == prefix_routing_key(ids[:32] + [5] * 8)


def test_request_keys() -> None:
    opts = dict(DEFAULTS)
    assert request_routing_key({"routing_key": "tenant-7", "prompt": [1] * 64}, opts) == "tenant-7"
    assert request_routing_key({"prompt": list(range(64))}, opts) == prefix_routing_key(range(64))
    assert request_routing_key({"prompt": "short text"}, opts) is None
    long_a = "system prompt " * 30
    assert request_routing_key({"prompt": long_a + "question 1"}, opts) == request_routing_key(
        {"prompt": long_a + "question 2"}, opts
    )
    assert request_routing_key([1, 2, 3], opts) is None  # not a generate request


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


# -- prefix-cache hits against Serve's default router (real Ray, 2 replicas each) -------------


@pytest.fixture(scope="module")
def pow2_app(serve_ports: ServePorts) -> Iterator[App]:
    from ray import serve

    from cluster.config import ServeConfig

    config = ServeConfig(
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

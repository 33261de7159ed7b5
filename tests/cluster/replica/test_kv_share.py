"""The cluster KV tier on a real Ray instance: two engines in two actors (the replicas'
side of the tier without Serve around it), the application's directory actor owning what
they publish in Ray's object store. A replica that never saw a prompt pulls its blocks from
the store and answers with the tokens of the replica that computed them; the objects
outlive their publisher; a block of another layout is never pulled; a lost directory or an
evicted object means recomputing, never a wrong token; the store stays within its budget."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest

from cluster.replica.kv_cost import PullCost
from cluster.replica.kv_directory import KvDirectory, delete_directory, directory_actor
from tests.cluster.serve_helpers import RaySession, store_bytes_within

MAX_TOKENS = 8


class Replica:
    """An engine and the replica's side of the tier, as LLMServer holds them."""

    async def __init__(self, demo_dir: str) -> None:
        from workers import AsyncEngine, EngineArgs

        args = EngineArgs(model=demo_dir, kv_offload_gib=1 / 64, kv_events=True, kv_share=True)
        self.config = args.create_config()
        self.engine = AsyncEngine(self.config)
        self.share = None

    def use(self, app: str, capacity: int, layout: str | None = None) -> None:
        """Joins application `app`'s tier (a test's own directory)."""
        from cluster.replica.kv_share import KvShare
        from cluster.replica.kv_store import node_store
        from workers.kv_layout import kv_block_bytes, kv_layout_key

        directory = directory_actor(app, capacity)
        # A slow prefill in the cost model: pulling always wins here (the cost model has its
        # own tests); the choice the test checks is the tier's, not the clock's.
        self.share = KvShare(
            directory,
            node_store(app, directory),
            layout or kv_layout_key(self.config),
            self.config.cache.block_size,
            kv_block_bytes(self.config, 1),
            cost=PullCost(prefill_tokens_per_s=1.0),
        )
        self.engine.kv_listener = None
        self.share.listen(self.engine)

    async def generate(self, prompt: list[int], rid: str) -> dict[str, Any]:
        from workers import SamplingParams

        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
        inp = self.engine.input_checker.request(params).prompt(prompt, self.engine.tokenizer)
        before = dict(self.share.outcomes)
        inp = await self.share.attach(inp)
        out = [o async for o in self.engine.generate_input(inp, rid)][-1]
        return {
            "tokens": list(out.outputs[0].token_ids),
            "cached": out.num_cached_tokens,
            "pulled": len(inp.kv_blocks),
            "outcome": next((k for k, v in self.share.outcomes.items() if v != before[k]), None),
        }

    def published(self) -> int:
        return self.share.published


@pytest.fixture(scope="module")
def replicas(ray_session: RaySession, demo_dir: Any) -> Iterator[tuple[Any, Any]]:
    """Two engine replicas, shared by the tests (each with prompts of its own)."""
    import ray

    a, b = (ray.remote(num_cpus=0)(Replica).remote(str(demo_dir)) for _ in range(2))
    yield a, b
    for r in (a, b):
        ray.kill(r)


@pytest.fixture
def app(ray_session: RaySession, request: pytest.FixtureRequest) -> Iterator[str]:
    name = f"kv-share-test-{request.node.name}"
    yield name
    delete_directory(name)


def _use(replicas: tuple[Any, ...], app: str, capacity: int = 1 << 26, layout: str | None = None):  # noqa: ANN202
    import ray

    ray.get([r.use.remote(app, capacity, layout) for r in replicas])
    return replicas


def _prompt(k: int) -> list[int]:
    """A test's own prompt: 6 full blocks of 16, and 4 tokens (no cache sees another's)."""
    return [10 + 100 * k + i for i in range(100)]


def _published(replica: Any, n: int) -> None:
    """Waits for the replica's thread to publish n blocks (hang guard: 30 s)."""
    import ray

    deadline = time.monotonic() + 30
    while ray.get(replica.published.remote()) < n:
        assert time.monotonic() < deadline, "the blocks were never published"
        time.sleep(0.05)


def test_another_layout_is_never_pulled(replicas, app) -> None:  # noqa: ANN001
    import ray

    a, other = replicas
    _use((a,), app)
    _use((other,), app, layout="another-checkpoint|torch.float32|tp1")
    prompt = _prompt(1)
    first = ray.get(a.generate.remote(prompt, "l-a"))
    _published(a, 6)
    second = ray.get(other.generate.remote(prompt, "l-o"))
    assert second["tokens"] == first["tokens"]
    assert second["pulled"] == 0 and second["outcome"] == "miss"


def test_a_lost_directory_means_recompute(replicas, app) -> None:  # noqa: ANN001
    """The directory (the last reference to every block) dies after the blocks were
    published: it comes back empty, the objects are freed; the peer recomputes, with the
    same tokens."""
    import ray

    from cluster.ray_internals import KVRAY_NAMESPACE
    from cluster.replica.kv_directory import directory_name

    a, b = _use(replicas, app)
    prompt = _prompt(2)
    first = ray.get(a.generate.remote(prompt, "d-a"))
    _published(a, 6)
    ray.kill(ray.get_actor(directory_name(app), namespace=KVRAY_NAMESPACE), no_restart=False)
    second = ray.get(b.generate.remote(prompt, "d-b"))
    assert second["tokens"] == first["tokens"]
    assert second["pulled"] == 0 and second["cached"] == 0
    assert second["outcome"] in ("miss", "failed")


def test_the_store_keeps_to_its_budget(replicas, app, demo_dir) -> None:  # noqa: ANN001
    """A budget of 4 blocks: the oldest are dropped (and freed, by Ray's count of the object
    store's bytes); a peer pulls the run from its start, which is nothing once the first
    block is gone; the application's tier deleted, its objects are all freed."""
    import ray

    from workers import EngineArgs
    from workers.kv_layout import kv_block_bytes

    per_block = kv_block_bytes(EngineArgs(model=str(demo_dir)).create_config(), 1)
    before = store_bytes_within(1 << 40)
    a, b = _use(replicas, app, capacity=4 * per_block)
    prompt = _prompt(3)
    first = ray.get(a.generate.remote(prompt, "s-a"))
    _published(a, 6)
    stats = ray.get(directory_actor(app, 4 * per_block).stats.remote())
    assert stats["blocks"] == 4 and stats["bytes"] <= 4 * per_block and stats["evicted"] == 2
    # Ray's own count: the evicted blocks' objects were freed (each object carries its
    # block and a few hundred bytes of header).
    # Ray's own count: the evicted blocks' objects are freed (each object carries its block
    # and a few hundred bytes of header; frees and the put's argument go asynchronously).
    store_bytes_within(before + 4 * (per_block + 4096))
    second = ray.get(b.generate.remote(prompt, "s-b"))
    assert second["tokens"] == first["tokens"]
    assert second["pulled"] == 0 and second["outcome"] == "miss"
    delete_directory(app)  # the application gone: every object of its tier is freed
    store_bytes_within(before + 4096)


def test_a_peer_pulls_what_a_dead_replica_computed(replicas, app) -> None:  # noqa: ANN001
    """Last: it kills replica A. Its blocks stay, owned by its node's store actor."""
    import ray

    a, b = _use(replicas, app)
    prompt = _prompt(4)
    first = ray.get(a.generate.remote(prompt, "p-a"))
    assert first["pulled"] == 0 and first["outcome"] == "miss"
    _published(a, 6)
    ray.kill(a)
    second = ray.get(b.generate.remote(prompt, "p-b"))
    assert second["tokens"] == first["tokens"]
    assert second["pulled"] == 6 and second["cached"] == 96 and second["outcome"] == "pulled"
    # B holds the prefix now: nothing to pull (its own device cache answers).
    again = ray.get(b.generate.remote(prompt + [8], "p-b2"))
    assert again["pulled"] == 0 and again["cached"] == 96 and again["outcome"] is None


def test_the_directory_keeps_lru_order_and_layouts_apart() -> None:
    """The directory's bookkeeping alone (no Ray: plain objects stand in for the refs)."""
    d = KvDirectory(capacity_bytes=30)
    assert d.publish("L", [(1, ["r1"], 10), (2, ["r2"], 10), (3, ["r3"], 10)]) == 3
    assert d.lookup("L", [1, 2]) == [["r1"], ["r2"]]  # 1 and 2 are now the most recent
    assert d.lookup("M", [1]) == []  # another layout
    assert d.publish("L", [(4, ["r4"], 10)]) == 1  # evicts 3, the least recently used
    assert d.lookup("L", [3]) == [] and d.lookup("L", [1, 2, 4]) == [["r1"], ["r2"], ["r4"]]
    assert d.publish("L", [(1, ["other"], 10)]) == 0  # already there: kept
    assert d.publish("L", [(9, ["big"], 31)]) == 0  # larger than the whole budget
    assert d.stats()["bytes"] == 30 and d.stats()["evicted"] == 1


def _share(block_bytes: int = 4) -> Any:
    from cluster.replica.kv_share import KvShare

    return KvShare(None, None, "L", block_size=2, block_bytes=block_bytes)


def _chain(ids: list[int], salt: int | None = None) -> list[Any]:
    """Blocks of 2 tokens over `ids`, as an engine exports them (4 bytes each)."""
    import numpy as np

    from workers.core.block_hash import chain_hash
    from workers.messages.kv_blocks import KvBlockData

    out, parent = [], None
    for i in range(0, len(ids) - 1, 2):
        tokens = tuple(ids[i : i + 2])
        h = chain_hash(parent, tokens, salt)
        out.append(KvBlockData(h, parent, tokens, salt, (np.zeros(4, np.uint8),)))
        parent = h
    return out


def test_pulled_blocks_are_checked_up_to_the_first_bad_one() -> None:
    """No Ray: the checks alone. A block of another layout, hash, salt, size or tokens ends
    the run (counted as refused); the blocks before it are kept."""
    from dataclasses import replace

    import numpy as np

    ids = [5, 6, 7, 8, 9, 10, 11]
    good = _chain(ids)
    hashes = [b.block_hash for b in good]
    share = _share()
    assert share._checked([("L", b) for b in good], hashes, ids, 0, None) == good
    bad = {
        "layout": ("M", good[1]),
        "tokens": ("L", replace(good[1], token_ids=(7, 0))),
        "salt": ("L", _chain(ids, salt=3)[1]),
        "bytes": ("L", replace(good[1], shards=(np.zeros(8, np.uint8),))),
        "parent": ("L", replace(good[1], parent_hash=123)),
    }
    for why, payload in bad.items():
        share = _share()
        got = share._checked([("L", good[0]), payload, ("L", good[2])], hashes, ids, 0, None)
        assert got == good[:1], why
        assert share.refused == 1, why


def test_the_mirror_follows_the_engines_kv_events() -> None:
    from workers.core.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

    share = _share()
    share.on_events((BlockStored((1, 2, 3), None, 2), BlockRemoved((2,))))
    assert share._mirror == {1, 3}
    share.on_events((AllBlocksCleared(), BlockStored((4,), None, 2)))
    assert share._mirror == {4}


def _finished(rid: str, prompt: int, cached: int, scheduled: float, first: float) -> Any:
    from workers.outputs import RequestMetrics, RequestOutput

    metrics = RequestMetrics(
        arrival_time=0.0,
        first_scheduled_time=scheduled,
        first_token_time=first,
        num_prompt_tokens=prompt,
        num_cached_tokens=cached,
    )
    return RequestOutput(rid, None, [], [], True, cached, metrics)


def test_a_pulls_cost_is_completed_by_its_first_token() -> None:
    """No Ray: a pulled request's whole cost (the fetch, then the engine restoring the
    blocks) is what the model learns; a computed one teaches the prefill rate."""
    from cluster.replica.kv_cost import LARGE_PULL_BYTES

    share = _share()
    share.cost.prefill_tokens_per_s = 1000.0
    nbytes = 8 * LARGE_PULL_BYTES
    share._pending["pulled"] = (nbytes, 0.1)  # what attach records for a pull
    # 0.5 s from its schedule to its first token, 100 of them computing the 100 tokens left.
    share.observe_finished(_finished("pulled", 1100, 1000, 10.0, 10.5))
    assert share.cost.pulls_seen == 1 and not share._pending
    fetch_only = _share().cost
    fetch_only.observe_pull(nbytes, 0.1)
    assert share.cost.pull_seconds(nbytes) > fetch_only.pull_seconds(nbytes) * 1.5
    assert share.cost.prefills_seen == 0  # 100 tokens after a pull say nothing of the rate
    share.observe_finished(_finished("computed", 1000, 0, 20.0, 20.5))  # 2000 tokens/s
    assert share.cost.prefills_seen == 1 and share.cost.prefill_tokens_per_s > 1000.0
    # What the replica publishes for the ingresses' disaggregation estimate: these figures.
    rates = share.rates()
    assert rates["prefill_tokens_per_s"] == share.cost.prefill_tokens_per_s
    assert rates["pull_bytes_per_s"] == share.cost.pull_bytes_per_s
    assert rates["kv_bytes_per_token"] == 4 // 2  # a block's bytes over its tokens


def test_the_tier_takes_at_most_half_the_smallest_object_store(app) -> None:  # noqa: ANN001
    import ray

    stores = [n["Resources"]["object_store_memory"] for n in ray.nodes() if n["Alive"]]
    stats = ray.get(directory_actor(app, 1 << 50).stats.remote())
    assert 0 < stats["capacity_bytes"] <= min(stores) / 2
    assert ray.get(directory_actor(app, 1 << 50).stats.remote()) == stats  # found, not resized

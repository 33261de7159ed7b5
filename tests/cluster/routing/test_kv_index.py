"""The KV index and the KV-event router's scoring, without Ray: payloads in any order,
duplicates and stale ones, gaps and snapshots, replica death and restart, bounded memory,
and the lookup cost per request (printed)."""

from __future__ import annotations

import asyncio
import random
import time

from cluster.ray_internals import standalone_router
from cluster.replica.kv_publish import KvPublisher
from cluster.routing.kv_index import KvIndex
from cluster.routing.kv_router import KvEventsRouter, prompt_block_hashes
from tests.cluster.routing.routing_kit import (
    BLOCK_SIZE,
    generate_request,
    kv_router,
    pending,
    replicas,
)
from workers.core.block_manager import BlockManager
from workers.core.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from workers.core.request import Seq
from workers.sampling_params import SamplingParams


def _stored(*hashes: int) -> BlockStored:
    return BlockStored(tuple(hashes), None, BLOCK_SIZE)


def _payloads(batches: list[tuple], snapshot_every: int = 1000) -> list[dict]:
    """One published payload after each batch of engine events."""
    pub = KvPublisher(epoch="e1", snapshot_every=snapshot_every)
    out = []
    for batch in batches:
        pub.on_events(batch)
        out.append(pub.publish())
    return out


def test_events_apply_once_whatever_the_order() -> None:
    p = _payloads([(), (_stored(1, 2, 3),), (BlockRemoved((2,)),), (_stored(4),)])
    idx = KvIndex()
    idx.update("r0", p[0])  # the first payload carries a snapshot (empty)
    # Arrival out of order: the newest first; older ones, and duplicates, change nothing.
    idx.update("r0", p[3])
    idx.update("r0", p[1])
    idx.update("r0", p[2])
    idx.update("r0", p[3])
    assert set(idx.replicas["r0"].blocks) == {1, 3, 4}
    assert idx.overlap("r0", [1, 2, 3], now=0.0) == 1  # 2 was removed: the chain stops there


def test_a_gap_waits_for_the_next_snapshot() -> None:
    pub = KvPublisher(epoch="e1", log_publishes=1, snapshot_every=3)
    idx = KvIndex()
    idx.update("r0", pub.publish())  # publish 0: snapshot
    pub.on_events((_stored(1),))
    pub.publish()  # missed by this router
    pub.on_events((_stored(2),))
    idx.update("r0", pub.publish())  # the log no longer reaches back: a gap
    assert idx.resyncs == 1 and idx.num_blocks("r0") == 0
    pub.on_events((BlockRemoved((1,)), _stored(5)))
    idx.update("r0", pub.publish())  # publish 3: snapshot
    assert set(idx.replicas["r0"].blocks) == {2, 5}


def test_cleared_empties_and_a_new_epoch_starts_over() -> None:
    idx = KvIndex()
    first, second = _payloads([(_stored(1, 2),), (AllBlocksCleared(), _stored(9))])
    idx.update("r0", second)  # no snapshot in it: a new router waits for one
    assert idx.num_blocks("r0") == 0
    idx.update("r0", first)
    assert set(idx.replicas["r0"].blocks) == {1, 2}
    idx.update("r0", second)
    assert set(idx.replicas["r0"].blocks) == {9}
    restarted = KvPublisher(epoch="e2")  # same replica id, another engine
    idx.update("r0", restarted.publish())
    assert idx.num_blocks("r0") == 0


def test_replicas_that_left_drop_out_and_new_ones_start_empty() -> None:
    idx = KvIndex()
    for rid in ("r0", "r1"):
        idx.update(rid, _payloads([(_stored(1, 2),)])[0])
    idx.retain(["r1", "r2"])
    assert set(idx.replicas) == {"r1"}
    assert idx.overlap("r2", [1, 2], now=0.0) == 0


def test_memory_is_bounded() -> None:
    idx = KvIndex(max_blocks=100, max_predicted=10)
    idx.update("r0", _payloads([tuple(_stored(i) for i in range(1000))])[0])
    assert idx.num_blocks("r0") == 100
    assert set(idx.replicas["r0"].blocks) == set(range(900, 1000))  # the oldest went
    idx.predict("r0", range(5000, 5050), now=0.0)
    assert len(idx.replicas["r0"].predicted) == 10


def test_predictions_expire() -> None:
    idx = KvIndex(predicted_ttl_s=5.0)
    idx.predict("r0", [1, 2], now=100.0)
    assert idx.overlap("r0", [1, 2, 3], now=101.0) == 2
    assert idx.overlap("r0", [1, 2, 3], now=106.0) == 0


def test_router_hashes_prompts_as_the_engine_does() -> None:
    bm = BlockManager(16, BLOCK_SIZE, kv_events=True)
    toks = list(range(3, 3 + 3 * BLOCK_SIZE + 5))
    seq = Seq("a", "a", 0, toks, SamplingParams(max_tokens=1))
    assert bm.allocate(seq, len(toks))
    seq.num_computed_tokens = len(toks)
    bm.commit_full_blocks(seq)
    (stored,) = bm.pop_kv_events()
    assert list(stored.block_hashes) == prompt_block_hashes(toks, BLOCK_SIZE, 256)
    # Exactly a block: the engine computes the last token, so its block is not reusable.
    assert len(prompt_block_hashes(toks[: 2 * BLOCK_SIZE], BLOCK_SIZE, 256)) == 1


def _router() -> KvEventsRouter:
    r = standalone_router(KvEventsRouter, "LLMServer", "kvray-test")
    r.initialize_state(block_size=BLOCK_SIZE)
    return r


def _kv(hashes: list[int], epoch: str = "e") -> dict:
    pub = KvPublisher(epoch=epoch)
    pub.on_events((BlockStored(tuple(hashes), None, BLOCK_SIZE),))
    return pub.publish()


def test_router_prefers_the_replica_holding_the_prefix_unless_it_is_loaded() -> None:
    async def go() -> None:
        r = _router()
        reps = replicas(2)
        prompt = list(range(100, 100 + 8 * BLOCK_SIZE + 3))
        hashes = prompt_block_hashes(prompt, BLOCK_SIZE, 256)
        reps[0].routing_stats = {"kv": _kv([7, 8])}
        reps[1].routing_stats = {"kv": _kv(hashes)}
        r.update_replicas(reps)  # type: ignore[arg-type]
        for _ in range(10):
            ranks = await r.choose_replicas(reps, pending(generate_request(prompt)))  # type: ignore[arg-type]
            assert ranks[0][0].name == "r1"
        # Busy enough that prefilling elsewhere is cheaper: the other replica.
        reps[1].routing_stats = {**reps[1].routing_stats, "waiting": 10}
        ranks = await r.choose_replicas(reps, pending(generate_request(prompt)))  # type: ignore[arg-type]
        assert ranks[0][0].name == "r0"
        # Or with prompt tokens enough waiting there (a prefill replica's queue).
        reps[1].routing_stats = {**reps[1].routing_stats, "waiting": 0, "queued_tokens": 4096}
        ranks = await r.choose_replicas(reps, pending(generate_request(prompt)))  # type: ignore[arg-type]
        assert ranks[0][0].name == "r0"
        # r1 leaves the deployment: its entries go at once.
        r.update_replicas(reps[:1])  # type: ignore[arg-type]
        await r.choose_replicas(reps[:1], pending(generate_request(prompt)))  # type: ignore[arg-type]
        assert set(r.index.replicas) == {"r0"}

    asyncio.run(go())


def test_with_the_cluster_kv_tier_a_hot_prefix_spreads_by_pulling() -> None:
    """r1 holds the prompt's 16 blocks and has one request waiting. Without the tier, r0
    would compute all 259 tokens: r1 wins despite its load. With it, r0 pulls them (each a
    quarter of a computed token): cheaper than r1's load, so r0 takes it."""

    async def go(kv_share: bool) -> str:
        r = kv_router(kv_share=kv_share, home_tokens=0.0)
        reps = replicas(2)
        prompt = list(range(100, 100 + 16 * BLOCK_SIZE + 3))
        reps[1].routing_stats = {"kv": _kv(prompt_block_hashes(prompt, BLOCK_SIZE, 256))}
        reps[1].routing_stats["waiting"] = 1
        r.update_replicas(reps)  # type: ignore[arg-type]
        ranks = await r.choose_replicas(reps, pending(generate_request(prompt)))  # type: ignore[arg-type]
        assert r.cost(reps[0], len(prompt), 0, 16 if kv_share else 0) == (  # type: ignore[arg-type]
            3 + 16 * BLOCK_SIZE * (0.25 if kv_share else 1)
        )
        return ranks[0][0].name

    assert asyncio.run(go(kv_share=False)) == "r1"
    assert asyncio.run(go(kv_share=True)) == "r0"


def test_a_prefix_nobody_holds_goes_to_its_home_replica() -> None:
    from cluster.routing.router import prefix_routing_key, rendezvous_rank

    async def go() -> None:
        r = _router()
        reps = replicas(3)
        r.update_replicas(reps)  # type: ignore[arg-type]
        rng = random.Random(3)
        for _ in range(10):
            prompt = [rng.randrange(5, 4000) for _ in range(5 * BLOCK_SIZE)]
            key = prefix_routing_key(prompt, BLOCK_SIZE, 4)
            home = rendezvous_rank(key, [c.name for c in reps])[0]  # type: ignore[arg-type]
            ranks = await r.choose_replicas(reps, pending(generate_request(prompt)))  # type: ignore[arg-type]
            assert ranks[0][0].name == home

    asyncio.run(go())


def test_router_predicts_where_it_sent_a_prompt() -> None:
    async def go() -> None:
        r = _router()
        reps = replicas(2)
        r.update_replicas(reps)  # type: ignore[arg-type]
        prompt = list(range(500, 500 + 4 * BLOCK_SIZE + 1))
        first = pending(generate_request(prompt))
        ranks = await r.choose_replicas(reps, first)  # type: ignore[arg-type]
        chosen = ranks[0][0]
        r.on_request_routed(first, chosen.replica_id, None)
        # No engine report yet, but the next request of that prefix follows the first.
        for _ in range(5):
            ranks = await r.choose_replicas(reps, pending(generate_request(prompt)))  # type: ignore[arg-type]
            assert ranks[0][0].name == chosen.name

    asyncio.run(go())


def test_lookup_cost_per_request() -> None:
    """Not a timed assert: prints the router's CPU per decision at a bench-like size."""

    async def go() -> float:
        r = _router()
        reps = replicas(4)
        rng = random.Random(0)
        tenants = [[rng.randrange(5, 4000) for _ in range(512)] for _ in range(32)]
        for i, rep in enumerate(reps):
            held = [h for t in tenants[i::4] for h in prompt_block_hashes(t, BLOCK_SIZE, 256)]
            rep.routing_stats = {"kv": _kv(held)}
        r.update_replicas(reps)  # type: ignore[arg-type]
        n = 500
        prompts = [
            rng.choice(tenants) + [rng.randrange(5, 4000) for _ in range(64)] for _ in range(n)
        ]
        started = time.thread_time()
        for p in prompts:
            await r.choose_replicas(reps, pending(generate_request(p)))  # type: ignore[arg-type]
        return (time.thread_time() - started) / n

    per = asyncio.run(go())
    print(f"kv_events router: {per * 1e6:.0f} us CPU per decision (576-token prompts, 4 replicas)")
    assert per > 0


def test_kv_events_router_is_wired_from_the_config() -> None:
    from cluster.config import ServeConfig
    from cluster.deploy.app import llm_server_options
    from cluster.routing.kv_router import KV_ROUTER_CLASS_PATH

    config = ServeConfig.from_flat(request_router="kv_events", device="cpu", block_size=32)
    router = llm_server_options(config)["request_router_config"]
    assert router.request_router_class == KV_ROUTER_CLASS_PATH
    assert router.request_router_kwargs == {"block_size": 32, "kv_share": False}
    shared = ServeConfig.from_flat(
        request_router="kv_events", device="cpu", kv_offload_gib=1, kv_share_gib=1
    )
    assert llm_server_options(shared)["request_router_config"].request_router_kwargs == {
        "block_size": 16,
        "kv_share": True,
    }
    # Engines record KV events only for the router that reads them.
    assert config.engine_kwargs("m")["kv_events"] is True
    assert ServeConfig.from_flat(device="cpu").engine_kwargs("m")["kv_events"] is False


def test_router_hashes_adapter_prompts_as_the_engine_does() -> None:
    from workers.lora.request import LoRARequest

    toks = list(range(3, 3 + 3 * BLOCK_SIZE + 5))
    by_salt = {}
    for lora in (None, 5, 6):
        bm = BlockManager(16, BLOCK_SIZE, kv_events=True)
        adapter = None if lora is None else LoRARequest(f"a{lora}", lora, "/a")
        seq = Seq("a", "a", 0, toks, SamplingParams(max_tokens=1), lora=adapter)
        assert bm.allocate(seq, len(toks))
        seq.num_computed_tokens = len(toks)
        bm.commit_full_blocks(seq)
        (stored,) = bm.pop_kv_events()
        assert list(stored.block_hashes) == prompt_block_hashes(toks, BLOCK_SIZE, 256, lora)
        by_salt[lora] = stored.block_hashes
    # Under each adapter (and the base model) the same tokens are other blocks.
    assert len({h for hashes in by_salt.values() for h in hashes}) == 3 * 3


def test_an_adapter_request_prefers_its_holder_and_no_other_adapters_prefix() -> None:
    async def go() -> None:
        r = _router()
        reps = replicas(2)
        prompt = list(range(100, 100 + 8 * BLOCK_SIZE + 3))
        # r0 holds the prompt's blocks as computed under adapter 1; r1 holds adapter 2.
        reps[0].routing_stats = {"kv": _kv(prompt_block_hashes(prompt, BLOCK_SIZE, 256, 1))}
        reps[1].routing_stats = {"kv": _kv([7]), "lora_adapters": (2,)}
        for _ in range(5):
            ranks = await r.choose_replicas(reps, pending(generate_request(prompt, lora=2)))  # type: ignore[arg-type]
            assert ranks[0][0].name == "r1"  # adapter 1's blocks are worth nothing to 2
        # Under adapter 1 r0's blocks count (and the load it would cost elsewhere).
        reps[0].routing_stats["lora_adapters"] = (1,)
        ranks = await r.choose_replicas(reps, pending(generate_request(prompt, lora=1)))  # type: ignore[arg-type]
        assert ranks[0][0].name == "r0"
        # The holder of 2 is far busier than r0 (more than the adapter load's worth, 4
        # requests, plus the home credit, 2): load outweighs the load of the adapter.
        r.replica_queue_len_cache.update(reps[1].replica_id, 7)
        ranks = await r.choose_replicas(reps, pending(generate_request(prompt, lora=2)))  # type: ignore[arg-type]
        assert ranks[0][0].name == "r0"

    asyncio.run(go())

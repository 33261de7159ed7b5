"""Property-based test of the block manager's invariants under random operations (its KV
events, replayed, always give exactly its prefix cache)."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from workers.core.block_manager import BlockManager
from workers.core.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from workers.core.request import Seq
from workers.sampling_params import SamplingParams

BS = 4
PARAMS = SamplingParams(max_tokens=100)

# Operations: (kind, seq slot, argument)
ops = st.lists(
    st.tuples(
        st.sampled_from(["new", "append", "share", "free", "evict", "grow"]),
        st.integers(0, 5),
        st.integers(1, 12),
    ),
    max_size=60,
)


def _check(bm: BlockManager, live: dict[int, Seq]) -> None:
    bm.check_invariants()
    refs = [0] * bm.num_blocks
    for seq in live.values():
        for b in seq.block_ids:
            refs[b] += 1
        assert len(seq.block_ids) * BS >= seq.num_computed_tokens
    assert refs == [b.ref_count for b in bm.blocks]
    # A cached hash maps to a block holding exactly the tokens the hash was built from.
    for seq in live.values():
        for i, h in enumerate(seq.block_hashes[: seq.num_computed_tokens // BS]):
            bid = bm.cached.get(h)
            if bid is not None:
                assert bm.blocks[bid].tokens == tuple(seq.token_ids[i * BS : (i + 1) * BS])


def _replay(events: tuple, cache: set[int]) -> None:
    for ev in events:
        if isinstance(ev, BlockStored):
            assert not cache & set(ev.block_hashes), "stored twice without a removal"
            cache.update(ev.block_hashes)
        elif isinstance(ev, BlockRemoved):
            assert set(ev.block_hashes) <= cache, "removed what was never stored"
            cache.difference_update(ev.block_hashes)
        else:
            assert isinstance(ev, AllBlocksCleared)
            cache.clear()


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=ops, vocab=st.integers(2, 4))
def test_random_operations_keep_invariants(ops, vocab) -> None:  # noqa: ANN001
    bm = BlockManager(num_blocks=12, block_size=BS, enable_caching=True, kv_events=True)
    replayed: set[int] = set()  # the cache as a KV-event reader sees it
    live: dict[int, Seq] = {}
    counter = 0
    for kind, slot, arg in ops:
        seq = live.get(slot)
        if kind in ("new", "share") and seq is None:
            # Small vocab: many identical blocks, so sharing through the cache really happens.
            base = live.get((slot + 1) % 6) if kind == "share" else None
            toks = (
                list(base.token_ids[:arg]) if base else [(counter + i) % vocab for i in range(arg)]
            )
            if not toks:
                continue
            counter += 1
            seq = Seq(f"s{counter}", f"r{counter}", 0, toks, PARAMS)
            cached = bm.lookup_prefix(seq)
            if bm.allocate(seq, seq.num_tokens - len(cached) * BS, cached):
                seq.num_computed_tokens = seq.num_tokens
                bm.commit_full_blocks(seq)
                live[slot] = seq
            else:
                assert seq.block_ids == []
        elif kind in ("append", "grow") and seq is not None:
            n = 1 if kind == "append" else arg
            seq.token_ids.extend((counter + i) % vocab for i in range(n))
            if bm.allocate(seq, n):
                seq.num_computed_tokens += n
                bm.commit_full_blocks(seq)
            else:
                seq.token_ids[-n:] = []
        elif kind == "free" and seq is not None:
            bm.free(seq)
            del live[slot]
        elif kind == "evict":
            bm.reset_prefix_cache()
        _check(bm, live)
        _replay(bm.pop_kv_events(), replayed)
        assert replayed == set(bm.cached)
    for seq in live.values():
        bm.free(seq)
    bm.check_invariants()
    assert bm.num_free_blocks == bm.num_blocks


def test_prefix_reuse_and_lru_eviction() -> None:
    bm = BlockManager(num_blocks=4, block_size=BS)
    a = Seq("a", "a", 0, list(range(9)), PARAMS)  # 2 full blocks + 1 token
    assert bm.allocate(a, 9)
    a.num_computed_tokens = 9
    bm.commit_full_blocks(a)
    b = Seq("b", "b", 0, list(range(8)) + [99, 98], PARAMS)
    hit = bm.lookup_prefix(b)
    assert hit == a.block_ids[:2]
    a_blocks = list(a.block_ids)
    bm.free(a)
    assert bm.num_free_blocks == 4 and len(bm.cached) == 2  # cached blocks stay resident
    c = Seq("c", "c", 0, [50] * 12, PARAMS)
    assert bm.allocate(c, 12)  # the two uncached blocks first, then one cached block
    # The prefix's tail block is evicted before its head (freed tail-first).
    assert list(bm.cached.values()) == [a_blocks[0]]
    bm.check_invariants()

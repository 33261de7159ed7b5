"""Property-based test of the block manager's invariants under random operations (its KV
events, replayed, always give exactly its prefix cache)."""

from __future__ import annotations

from hypothesis import HealthCheck, example, given, settings
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


# ------------------------------------------------------------------------- commit watermark


class _EveryBlock(BlockManager):
    """The oracle: a commit that walks every full block of the sequence, every call."""

    def commit_full_blocks(self, seq: Seq) -> None:
        computed = min(seq.num_computed_tokens, seq.num_tokens)
        full = min(computed // self.block_size, len(seq.block_ids))
        hashes = self._hashes(seq, full)
        stored: list[int] = []
        for i in range(full):
            block = self.blocks[seq.block_ids[i]]
            if block.block_hash is not None or hashes[i] in self.cached:
                continue
            block.block_hash, block.parent_hash = hashes[i], hashes[i - 1] if i else None
            block.tokens = tuple(seq.token_ids[i * BS : (i + 1) * BS])
            self.cached[hashes[i]] = block.block_id
            if stored and stored[-1] != block.parent_hash:
                self.kv_events.stored(stored, self.blocks[self.cached[stored[0]]].parent_hash)
                stored = []
            stored.append(hashes[i])
        if stored:
            self.kv_events.stored(stored, self.blocks[self.cached[stored[0]]].parent_hash)


def _state(bm: BlockManager) -> tuple:
    blocks = [(b.ref_count, b.block_hash, b.tokens, b.parent_hash) for b in bm.blocks]
    return blocks, list(bm.cached.items()), list(bm.free_queue), bm.pop_kv_events()


watermark_ops = st.lists(
    st.tuples(
        st.sampled_from(["new", "twin", "append", "ahead", "grow", "free", "evict"]),
        st.integers(0, 5),
        st.integers(1, 12),
    ),
    max_size=60,
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=watermark_ops, vocab=st.integers(2, 4))
# A duplicate, then its twin's hash leaves the cache: the duplicate is committed next time.
@example(ops=[("new", 0, 8), ("twin", 1, 1), ("free", 0, 1), ("evict", 0, 1), ("append", 1, 1)],
         vocab=3)  # fmt: skip
def test_the_watermark_commits_what_a_walk_over_every_block_does(ops, vocab) -> None:  # noqa: ANN001
    """Same blocks, hashes, LRU order and KV events as the full walk, through prefix hits,
    duplicates (a twin computes a prompt another sequence is computing too), tokens still in
    flight (async scheduling), frees, evictions and resets."""
    managers = [BlockManager(12, BS, kv_events=True), _EveryBlock(12, BS, kv_events=True)]
    live: list[dict[int, Seq]] = [{}, {}]
    counter = 0
    for kind, slot, arg in ops:
        counter += 1
        for bm, seqs in zip(managers, live, strict=True):
            seq = seqs.get(slot)
            if kind in ("new", "twin") and seq is None:
                twin = next(iter(seqs.values()), None)  # the oldest live sequence
                toks = list(twin.token_ids) if kind == "twin" and twin else None
                toks = toks or [(counter + i) % vocab for i in range(arg)]
                seq = Seq(f"s{counter}", f"r{counter}", 0, toks, PARAMS)
                cached = bm.lookup_prefix(seq) if kind == "new" else []
                if bm.allocate(seq, seq.num_tokens - len(cached) * BS, cached):
                    seq.num_computed_tokens = seq.num_tokens
                    bm.commit_full_blocks(seq)
                    seqs[slot] = seq
            elif kind in ("append", "grow", "ahead") and seq is not None:
                n = arg if kind == "grow" else 1
                if bm.allocate(seq, n):
                    seq.num_computed_tokens += n
                    if kind == "ahead":  # its token's value arrives after the commit
                        bm.commit_full_blocks(seq)
                    seq.token_ids.extend((counter + i) % vocab for i in range(n))
                    bm.commit_full_blocks(seq)
            elif kind == "free" and seq is not None:
                bm.free(seq)
                del seqs[slot]
            elif kind == "evict":
                bm.reset_prefix_cache()
        assert _state(managers[0]) == _state(managers[1])
        managers[0].check_invariants()


def test_a_commit_looks_only_at_the_blocks_filled_since_the_last() -> None:
    """Decoding a long sequence token by token looks at each block once (a walk over every
    full block at each step would look at ~n^2/2 of them)."""
    bm = BlockManager(num_blocks=80, block_size=BS)
    seq = Seq("long", "long", 0, [1, 2, 3], PARAMS)
    assert bm.allocate(seq, 3)
    seq.num_computed_tokens = 3
    for t in range(64 * BS):
        assert bm.allocate(seq, 1)
        seq.num_computed_tokens += 1
        seq.token_ids.append(t)
        bm.commit_full_blocks(seq)
    full = seq.num_tokens // BS
    assert bm.commit_visits == full and len(bm.cached) == full
    assert len(seq.block_hashes) == full  # each block hashed once too


def test_a_duplicate_block_is_committed_once_its_twins_hash_leaves_the_cache() -> None:
    bm = BlockManager(num_blocks=6, block_size=BS)
    a, b = (Seq(s, s, 0, list(range(8)), PARAMS) for s in "ab")  # computed side by side
    for seq in (a, b):
        assert bm.allocate(seq, 8)
        seq.num_computed_tokens = 8
        bm.commit_full_blocks(seq)
    assert sorted(bm.cached.values()) == a.block_ids and b.duplicate_blocks == [0, 1]
    bm.commit_full_blocks(b)  # nothing left the cache: no second look
    assert bm.commit_visits == 4
    bm.free(a)
    bm.reset_prefix_cache()  # drops a's blocks: b's may now hold the content
    bm.commit_full_blocks(b)
    assert sorted(bm.cached.values()) == b.block_ids and b.duplicate_blocks == []

"""The host KV tier's bookkeeping: LRU by bytes, the step's transfers, salt separation, and
(property-based) that a simulated device and host pool, applying the transfers as a rank
does, always hold in every cached block exactly the tokens its hash names."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from workers.core.block_manager import BlockManager
from workers.core.host_tier import HostTier
from workers.core.request import Seq
from workers.kv_layout import kv_block_bytes
from workers.lora.request import LoRARequest
from workers.messages.step import KvTransfers
from workers.sampling_params import SamplingParams

BS = 4
BLOCK_BYTES = 1000
PARAMS = SamplingParams(max_tokens=100)


def _toks(k: int) -> tuple[int, ...]:
    return tuple(range(k * BS, (k + 1) * BS))


def test_lru_bounded_by_bytes() -> None:
    tier = HostTier(capacity_bytes=3 * BLOCK_BYTES + 999, block_bytes=BLOCK_BYTES, block_size=BS)
    assert tier.capacity_blocks == 3 and tier.capacity_bytes == 3 * BLOCK_BYTES
    for h in (1, 2, 3):
        tier.save(h, _toks(h), block_id=h)
    tier.save(1, _toks(1), block_id=7)  # already held: touched (most recent), not copied again
    tier.save(4, _toks(4), block_id=4)  # full: the least recently used (2) goes
    assert list(tier.entries) == [3, 1, 4]
    assert tier.num_blocks == 3 and tier.num_bytes == 3 * BLOCK_BYTES
    assert (tier.copies_out, tier.evictions) == (4, 1)
    t = tier.pop_transfers()
    assert t.saves == [(1, 1), (2, 2), (3, 3), (4, 4)] and t.drops == [2] and t.loads == []
    assert tier.pop_transfers() is None  # nothing new
    tier.check_invariants()


def test_take_and_load_count_hits_and_keep_the_entries() -> None:
    tier = HostTier(4 * BLOCK_BYTES, BLOCK_BYTES, BS)
    for h in (1, 2):
        tier.save(h, _toks(h), block_id=h)
    tier.pop_transfers()
    assert tier.holds(1, _toks(1)) and not tier.holds(1, _toks(2))  # collision guard
    tier.save(3, _toks(3), block_id=3)
    assert tier.take([1, 2]) == [_toks(1), _toks(2)]
    tier.load(1, 5)
    tier.load(2, 6)
    tier.check_invariants()
    # They stay (inclusive), now the most recently used.
    assert list(tier.entries) == [3, 1, 2] and (tier.copies_in, tier.hit_tokens) == (2, 2 * BS)
    assert tier.pop_transfers() == KvTransfers(saves=[(3, 3)], loads=[(1, 5), (2, 6)])


def test_same_step_orders_stay_equivalent_to_grouped_application() -> None:
    tier = HostTier(BLOCK_BYTES, BLOCK_BYTES, BS)  # one block
    tier.save(1, _toks(1), block_id=1)
    tier.save(2, _toks(2), block_id=2)  # drops 1
    tier.save(1, _toks(1), block_id=3)  # drops 2; cancels 1's drop (the save rewrites it)
    tier.check_invariants()
    t = tier.pop_transfers()
    # Applied as saves, loads, drops: the pool ends with exactly what the tier holds.
    pool: dict[int, int] = {}
    for h, b in t.saves:
        pool[h] = b
    for h in t.drops:
        pool.pop(h, None)
    assert pool.keys() == tier.entries.keys() == {1} and pool[1] == 3
    # A block restored this step is not saved in it (the save would read it before the load).
    tier.take([1])
    tier.load(1, 9)
    tier.save(5, _toks(5), block_id=9)
    assert list(tier.entries) == [1]
    assert tier.pop_transfers() == KvTransfers(loads=[(1, 9)])
    # A hash dropped in the step that loads it: the load reads the pool before the drop.
    tier.take([1])
    tier.load(1, 2)
    tier.save(6, _toks(6), block_id=6)  # drops 1
    tier.check_invariants()
    assert tier.pop_transfers() == KvTransfers(saves=[(6, 6)], loads=[(1, 2)], drops=[1])


def test_clear_drops_everything() -> None:
    tier = HostTier(4 * BLOCK_BYTES, BLOCK_BYTES, BS)
    tier.save(1, _toks(1), 1)
    tier.clear()
    tier.check_invariants()
    assert tier.num_blocks == 0
    t = tier.pop_transfers()
    assert t.saves == [(1, 1)] and t.drops == [1]


def _filled(bm: BlockManager, toks: list[int], sid: str, lora: LoRARequest | None = None) -> Seq:
    """A sequence admitted as the scheduler does: device prefix, host restore, the rest."""
    seq = Seq(sid, sid, 0, list(toks), PARAMS, lora=lora)
    cached = bm.lookup_prefix(seq)
    restore = bm.lookup_host(seq, len(cached))
    assert bm.allocate(seq, seq.num_tokens - (len(cached) + len(restore)) * BS, cached, restore)
    seq.num_computed_tokens = seq.num_tokens
    bm.commit_full_blocks(seq)
    return seq


def test_evicted_blocks_restore_only_under_the_same_salt() -> None:
    bm = BlockManager(4, BS, host_tier=HostTier(8 * BLOCK_BYTES, BLOCK_BYTES, BS))
    prompt = list(range(13))  # 3 full blocks + 1
    a = _filled(bm, prompt, "a")
    bm.free(a)
    bm.free(_filled(bm, [90 + i for i in range(13)], "other"))  # evicts a's 3 blocks
    assert bm.host_tier.num_blocks == 3 and not set(a.block_hashes[:3]) & bm.cached.keys()
    bm.pop_kv_transfers()
    lora = LoRARequest("x", 1, "/nowhere")
    c = Seq("c", "c", 0, list(prompt), PARAMS, lora=lora)
    assert bm.lookup_prefix(c) == [] and bm.lookup_host(c, 0) == []  # another salt
    b = Seq("b", "b", 0, prompt[:12] + [77, 78], PARAMS)
    assert bm.lookup_prefix(b) == [] and bm.lookup_host(b, 0) == a.block_hashes[:3]
    bm.check_invariants()


def test_for_engine_sizes_over_all_ranks(demo_dir) -> None:  # noqa: ANN001
    from dataclasses import replace

    from workers.config import EngineArgs

    config = EngineArgs(model=str(demo_dir), kv_offload_gib=1 / 1024).create_config()
    tier = HostTier.for_engine(config)
    assert tier.block_bytes == kv_block_bytes(config, 1) and tier.capacity_bytes <= 1 << 20
    assert tier.capacity_blocks == (1 << 20) // tier.block_bytes
    zero = replace(config.cache, kv_offload_gib=0)
    assert HostTier.for_engine(replace(config, cache=zero)) is None
    off = replace(config.cache, enable_prefix_caching=False)
    assert HostTier.for_engine(replace(config, cache=off)) is None
    with pytest.raises(ValueError, match="kv_offload_gib"):
        EngineArgs(model=str(demo_dir), kv_offload_gib=-1).create_config()


# -------------------------------------------------------------- simulated device and pool

ops = st.lists(
    st.tuples(
        st.sampled_from(["new", "new", "new", "grow", "step", "reset"]),
        st.integers(0, 2),
        st.integers(4, 24),
    ),
    min_size=10,
    max_size=60,
)


class _Sim:
    """The device's blocks (a token per slot) and a rank's pool, changed only as a rank
    applies a step: transfers (saves, loads, drops), then the forward's writes."""

    def __init__(self, bm: BlockManager) -> None:
        self.bm = bm
        self.device: list[list[int | None]] = [[None] * BS for _ in range(bm.num_blocks)]
        self.pool: dict[int, list[int | None]] = {}
        self.writes: list[tuple[Seq, int, int]] = []  # (seq, first position, end) to compute

    def step(self) -> None:
        t = self.bm.pop_kv_transfers() or KvTransfers()
        for h, b in t.saves:
            self.pool[h] = list(self.device[b])
        for h, b in t.loads:
            self.device[b] = list(self.pool[h])
        for h in t.drops:
            self.pool.pop(h, None)
        for seq, start, end in self.writes:
            for p in range(start, end):
                self.device[seq.block_ids[p // BS]][p % BS] = seq.token_ids[p]
        self.writes = []

    def check(self, live: dict[int, Seq]) -> None:
        self.bm.check_invariants()
        tier = self.bm.host_tier
        assert self.pool.keys() == tier.entries.keys()
        for h, tokens in tier.entries.items():
            assert tuple(self.pool[h]) == tokens, "the pool lost a block's contents"
        for bid in self.bm.cached.values():
            assert tuple(self.device[bid]) == self.bm.blocks[bid].tokens, f"block {bid} wrong"
        for seq in live.values():  # every computed position holds its token
            for p in range(seq.num_computed_tokens):
                assert self.device[seq.block_ids[p // BS]][p % BS] == seq.token_ids[p]


def test_sim_restores_an_evicted_prefix_in_the_step_that_evicts_more() -> None:
    """The deterministic case of the property below: a prompt's blocks go to the host, and
    the step that restores them also saves the blocks its allocation evicts."""
    bm = BlockManager(6, BS, host_tier=HostTier(3 * BLOCK_BYTES, BLOCK_BYTES, BS))
    sim = _Sim(bm)
    for sid, toks in (("a", range(17)), ("b", range(100, 117)), ("c", range(13))):
        seq = _filled(bm, list(toks), sid)
        restored = bm.host_tier.copies_in
        sim.writes.append((seq, (len(seq.block_ids) - 1) * BS if restored else 0, len(toks)))
        if sid == "c":  # a's head is still on the device, its next 2 blocks come back
            t = bm.host_tier._pending
            assert len(t.loads) == 2 and t.saves  # the step restores and saves
        sim.step()
        sim.check({seq.seq_id: seq})
        bm.free(seq)
    bm.check_invariants()
    assert bm.host_tier.copies_in == 2 and bm.host_tier.hit_tokens == 2 * BS


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=ops, capacity=st.integers(1, 6), salted=st.booleans())
def test_transfers_keep_device_and_pool_right(ops, capacity, salted) -> None:  # noqa: ANN001
    bm = BlockManager(10, BS, host_tier=HostTier(capacity * BLOCK_BYTES, BLOCK_BYTES, BS))
    sim = _Sim(bm)
    live: dict[int, Seq] = {}
    counter = 0
    for kind, slot, arg in ops:
        counter += 1
        seq = live.get(slot)
        if kind in ("new", "reset", "step"):
            sim.step()  # between steps, as the engine frees and resets
            sim.check(live)
        if kind == "new":
            if seq is not None:  # the slot's sequence ends: its blocks go to the free queue
                bm.free(live.pop(slot))
            # Two families of prompts, prefixes of each other: shared blocks, each block's
            # tokens telling where it belongs.
            toks = [slot % 2 * 100 + i for i in range(arg)]
            lora = LoRARequest("x", 1, "/x") if salted and counter % 3 == 0 else None
            seq = Seq(f"s{counter}", f"r{counter}", 0, toks, PARAMS, lora=lora)
            cached = bm.lookup_prefix(seq)
            restore = bm.lookup_host(seq, len(cached))
            done = (len(cached) + len(restore)) * BS
            if bm.allocate(seq, seq.num_tokens - done, cached, restore):
                seq.num_computed_tokens = seq.num_tokens
                sim.writes.append((seq, done, seq.num_tokens))
                bm.commit_full_blocks(seq)
                live[slot] = seq
        elif kind == "grow" and seq is not None:
            start = seq.num_tokens
            seq.token_ids.extend(200 + (counter + i) % 3 for i in range(arg))
            if bm.allocate(seq, arg):
                seq.num_computed_tokens += arg
                sim.writes.append((seq, start, seq.num_tokens))
                bm.commit_full_blocks(seq)
            else:
                del seq.token_ids[start:]
        elif kind == "reset":
            bm.reset_prefix_cache()
    sim.step()
    sim.check(live)
    for seq in live.values():
        bm.free(seq)
    bm.check_invariants()
    assert bm.num_free_blocks == bm.num_blocks

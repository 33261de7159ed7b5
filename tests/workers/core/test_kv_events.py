"""KV events: the block manager reports what enters and leaves its prefix cache, bounded, off
by default; both engine cores hand them to AsyncEngine's listener; hashes are the same in
every process (a router recomputes them)."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import pytest

from workers import AsyncEngine, SamplingParams
from workers.config import EngineArgs
from workers.core.block_manager import BlockManager, chain_hash
from workers.core.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KvEventRecorder
from workers.core.request import Seq

BS = 4
PARAMS = SamplingParams(max_tokens=8)


def _run(bm: BlockManager, seq_id: str, toks: list[int]) -> Seq:
    """Allocate and fully compute a prompt, committing its full blocks."""
    seq = Seq(seq_id, seq_id, 0, toks, PARAMS)
    cached = bm.lookup_prefix(seq)
    seq.num_computed_tokens = len(cached) * BS
    assert bm.allocate(seq, len(toks) - seq.num_computed_tokens, cached)
    seq.num_computed_tokens = len(toks)
    bm.commit_full_blocks(seq)
    return seq


def _hashes(toks: list[int]) -> list[int]:
    out, parent = [], None
    for i in range(len(toks) // BS):
        parent = chain_hash(parent, tuple(toks[i * BS : (i + 1) * BS]))
        out.append(parent)
    return out


def test_off_by_default_and_costs_nothing() -> None:
    bm = BlockManager(8, BS)
    _run(bm, "a", list(range(9)))
    assert bm.kv_events is None and bm.pop_kv_events() == ()


def test_stored_removed_cleared_in_order() -> None:
    bm = BlockManager(4, BS, kv_events=True)
    a = list(range(8))
    seq = _run(bm, "a", a)
    h = _hashes(a)
    assert bm.pop_kv_events() == (BlockStored(tuple(h), None, BS),)
    assert bm.pop_kv_events() == ()  # popped once
    bm.free(seq)
    # Another prompt needs all 4 blocks: both cached ones are evicted (LRU first).
    b = [100 + i for i in range(16)]
    seq_b = _run(bm, "b", b)
    events = bm.pop_kv_events()
    removed = [x for e in events if isinstance(e, BlockRemoved) for x in e.block_hashes]
    assert sorted(removed) == sorted(h)
    assert events[-1] == BlockStored(tuple(_hashes(b)), None, BS)
    bm.free(seq_b)
    bm.reset_prefix_cache()
    assert bm.pop_kv_events() == (AllBlocksCleared(),)


def test_stored_extends_a_chain_with_its_parent() -> None:
    bm = BlockManager(8, BS, kv_events=True)
    a = list(range(8))
    _run(bm, "a", a)
    bm.pop_kv_events()
    longer = a + [50, 51, 52, 53, 54]
    _run(bm, "b", longer)
    h = _hashes(longer)
    assert bm.pop_kv_events() == (BlockStored((h[2],), h[1], BS),)


def test_overflow_answers_a_snapshot_of_the_cache() -> None:
    bm = BlockManager(16, BS, kv_events=True)
    bm.kv_events = KvEventRecorder(bm._cached_chain, BS, max_pending=3)
    seqs = [_run(bm, f"s{i}", [i * 100 + t for t in range(8)]) for i in range(3)]
    events = bm.pop_kv_events()
    assert bm.kv_events.num_dropped > 0
    assert events[0] == AllBlocksCleared()
    snap = {e.block_hashes[0]: e.parent_hash for e in events[1:]}
    assert snap == {h: p for h, p in bm._cached_chain()}
    assert len(snap) == 6 and all(isinstance(e, BlockStored) for e in events[1:])
    assert bm.pop_kv_events() == ()
    del seqs


def test_chain_hash_is_the_same_in_another_process() -> None:
    toks = (1, 2, 3, 4)
    code = (
        "from workers.core.block_manager import chain_hash;"
        "print(chain_hash(chain_hash(None, (1, 2, 3, 4)), (5, 6, 7, 8), 'salt'))"
    )
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert other.returncode == 0, other.stderr
    assert int(other.stdout) == chain_hash(chain_hash(None, toks), (5, 6, 7, 8), "salt")


@pytest.mark.parametrize("process", [False, True], ids=["thread", "process"])
def test_both_cores_deliver_events_to_the_listener(demo_dir, process: bool) -> None:
    args = EngineArgs(model=str(demo_dir), kv_cache_memory_bytes=16 << 20, kv_events=True)
    eng = AsyncEngine(args, process=process)
    got: list = []
    eng.kv_listener = got.extend
    prompt = list(range(5, 5 + 4 * args.block_size + 3))

    async def main() -> None:
        params = SamplingParams(max_tokens=2, temperature=0.0)
        async for _ in eng.generate(prompt, params, "r1"):
            pass

    try:
        asyncio.run(main())
    finally:
        eng.shutdown()
    stored = [h for e in got if isinstance(e, BlockStored) for h in e.block_hashes]
    expect, parent = [], None
    for i in range(4):
        parent = chain_hash(parent, tuple(prompt[i * args.block_size : (i + 1) * args.block_size]))
        expect.append(parent)
    assert stored[:4] == expect

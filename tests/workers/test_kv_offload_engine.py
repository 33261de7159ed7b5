"""The host KV tier end to end on the demo model: a shared prefix evicted from a device cache
too small to keep it comes back from host memory, with the greedy tokens of a run without
the tier (and of transformers), and fewer prompt tokens computed."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from tests.workers.parity import assert_outputs_match_hf
from workers import LLM, AsyncEngine, SamplingParams
from workers.config import EngineArgs
from workers.kv_layout import kv_block_bytes

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
PREFIX = list(range(10, 110))  # 6 full blocks of 16 (and 4 tokens)
# A, three prompts that evict A's blocks from a 12-block cache, then B sharing A's prefix.
PROMPTS = [
    PREFIX + [200, 201, 202],
    *([300 + 7 * k + i for i in range(120)] for k in range(3)),
    PREFIX + [400, 401, 402, 403],
]
GIB = 1 / 64  # 16 MiB: room for every block these prompts fill


def _args(demo_dir: Path, gib: float, **kw) -> EngineArgs:  # noqa: ANN003
    config = EngineArgs(model=str(demo_dir)).create_config()
    per_block = kv_block_bytes(config, 1)
    # 12 blocks: one prompt at a time fits, the shared prefix does not stay resident.
    return EngineArgs(
        model=str(demo_dir), kv_cache_memory_bytes=12 * per_block, kv_offload_gib=gib, **kw
    )


def _run(args: EngineArgs) -> tuple[list, object, int]:
    """Each prompt in turn (the evictions need them one after another)."""
    from dataclasses import asdict

    llm = LLM(**asdict(args))
    outs = [llm.generate([p], GREEDY, use_tqdm=False)[0] for p in PROMPTS]
    llm.engine.block_manager.check_invariants()
    return outs, llm.stats(), sum(llm.engine.pop_step_token_counts())


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_evicted_prefix_is_restored_not_recomputed(demo_dir, async_scheduling) -> None:  # noqa: ANN001
    on, on_stats, on_tokens = _run(_args(demo_dir, GIB, async_scheduling=async_scheduling))
    off, off_stats, off_tokens = _run(_args(demo_dir, 0, async_scheduling=async_scheduling))
    assert [o.outputs[0].token_ids for o in on] == [o.outputs[0].token_ids for o in off]
    # A's 6 full prefix blocks come back for B (none of them is on the device any more).
    assert on_stats.kv_offload_hit_tokens == 6 * 16 and on_stats.kv_offload_copies_in == 6
    assert on_stats.prefix_cache_hits == off_stats.prefix_cache_hits == 0
    assert on[-1].num_cached_tokens == 96 and off[-1].num_cached_tokens == 0
    assert on_tokens == off_tokens - 96  # those tokens were not computed again
    assert on_stats.kv_offload_copies_out >= 6 and on_stats.kv_offload_evictions == 0
    assert on_stats.kv_offload_bytes == on_stats.kv_offload_blocks * _block_bytes(demo_dir)
    assert off_stats.kv_offload_copies_out == off_stats.kv_offload_hit_tokens == 0
    if not async_scheduling:
        assert_outputs_match_hf(demo_dir, PROMPTS, on, GREEDY.max_tokens)


def _block_bytes(demo_dir: Path) -> int:
    return kv_block_bytes(EngineArgs(model=str(demo_dir)).create_config(), 1)


def test_a_tier_too_small_evicts_and_stays_right(demo_dir) -> None:  # noqa: ANN001
    """Room for 4 blocks: the tier drops its oldest, and B gets back what is left of A."""
    gib = 4 * _block_bytes(demo_dir) / (1 << 30)
    on, stats, _ = _run(_args(demo_dir, gib))
    off, _, _ = _run(_args(demo_dir, 0))
    assert [o.outputs[0].token_ids for o in on] == [o.outputs[0].token_ids for o in off]
    assert stats.kv_offload_blocks <= 4 and stats.kv_offload_evictions > 0
    assert stats.kv_offload_capacity_bytes == 4 * _block_bytes(demo_dir)


def test_the_engine_in_its_child_process_restores_too(demo_dir) -> None:  # noqa: ANN001
    eng = AsyncEngine(_args(demo_dir, GIB), process=True)

    async def one(k: int) -> list[int]:
        outs = [o async for o in eng.generate(PROMPTS[k], GREEDY, f"r{k}")]
        return outs[-1].outputs[0].token_ids

    try:
        tokens = [asyncio.run(one(k)) for k in range(len(PROMPTS))]
        stats = eng.stats()
    finally:
        eng.shutdown()
    off, _, _ = _run(_args(demo_dir, 0))
    assert tokens == [o.outputs[0].token_ids for o in off]
    assert stats.kv_offload_hit_tokens == 96


def test_preempted_sequences_get_their_blocks_back_from_the_tier(demo_dir) -> None:  # noqa: ANN001
    """A preempted sequence's blocks go back to the free queue; those evicted before it runs
    again are restored from the tier instead of recomputed, with the tokens of a cache large
    enough never to preempt."""
    import random

    rng = random.Random(2)
    prefix = [rng.randrange(3, 3800) for _ in range(64)]
    prompts = [
        prefix + [rng.randrange(3, 3800) for _ in range(n)]
        for n in (5, 60, 120, 150, 9, 33, 70, 100)
    ]
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    ref = LLM(str(demo_dir), kv_cache_memory_bytes=16 << 20).generate(
        prompts, params, use_tqdm=False
    )
    per_block = _block_bytes(demo_dir)
    llm = LLM(
        str(demo_dir),
        kv_cache_memory_bytes=20 * per_block,
        max_num_batched_tokens=64,
        kv_offload_gib=GIB,
    )
    out = llm.generate(prompts, params, use_tqdm=False)
    stats = llm.stats()
    llm.engine.block_manager.check_invariants()
    assert [o.outputs[0].token_ids for o in out] == [o.outputs[0].token_ids for o in ref]
    assert stats.num_preemptions > 0 and stats.kv_offload_hit_tokens > 0
    assert stats.kv_blocks_used == 0

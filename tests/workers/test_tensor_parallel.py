"""Tensor parallelism on CPU (gloo) with Ray worker actors: same tokens as TP=1 and HF."""

from __future__ import annotations

import random
from typing import Any

import pytest
import ray

from tests.checkpoints import KINDS, hf_greedy, hf_logprobs, load_hf, make_checkpoint
from tests.workers.failures import fail_while_streaming
from tests.workers.parity import assert_greedy_match
from workers import LLM, AsyncEngine, SamplingParams
from workers.config import EngineArgs
from workers.errors import EngineDeadError

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=3)


@pytest.fixture(scope="module", autouse=True)
def ray_cluster(ray_session: object) -> None:
    """The TP ranks run as actors of the session's Ray instance (tests/conftest.py)."""


def _prompts(seed: int, lengths=(1, 7, 16, 33, 90, 200)) -> list[list[int]]:  # noqa: ANN001
    rng = random.Random(seed)
    return [[rng.randrange(3, 3800) for _ in range(n)] for n in lengths]


def _tp2_generate(path: str, prompts: list[list[int]]) -> tuple[list[Any], list[int]]:
    """Greedy outputs at TP = 2, and each rank's weight bytes."""
    llm = LLM(path, tensor_parallel_size=2, kv_cache_memory_bytes=16 << 20)
    try:
        return llm.generate(prompts, GREEDY, use_tqdm=False), llm.engine.executor.param_bytes()
    finally:
        llm.engine.shutdown()


def _assert_halves(per_rank: list[int], total: int) -> None:
    for b in per_rank:
        assert abs(b - total / 2) / (total / 2) < 0.05, (per_rank, total)


@pytest.mark.parametrize("kind", KINDS)
def test_tp2_matches_tp1_and_transformers(kind: str, checkpoints) -> None:
    path = str(checkpoints[kind])
    prompts = _prompts(1)
    tp1 = LLM(path, kv_cache_memory_bytes=16 << 20).generate(prompts, GREEDY, use_tqdm=False)
    tp2, per_rank = _tp2_generate(path, prompts)
    total = LLM(path, kv_cache_memory_bytes=1 << 20).engine.executor.worker.param_bytes()
    # Embeddings and LM head are vocab-parallel too; only the norms are replicated.
    _assert_halves(per_rank, total)
    hf = load_hf(path)
    for prompt, a, b in zip(prompts, tp1, tp2, strict=True):
        ta, tb = a.outputs[0].token_ids, b.outputs[0].token_ids
        assert_greedy_match(hf, prompt, tb, ta)
        assert_greedy_match(hf, prompt, tb, hf_greedy(hf, prompt, 10))
        rows = hf_logprobs(hf, prompt, tb)
        for row, tok, lp in zip(rows, tb, b.outputs[0].logprobs, strict=True):
            assert abs(lp[tok] - row[tok].item()) < 1e-4


def test_tp2_of_a_bfloat16_checkpoint_matches_transformers(tmp_path) -> None:
    # Each rank packs bfloat16 copies of its own weight slices (workers/device/layers/linear.py);
    # qwen2: biases on the column-parallel q/k/v.
    path = str(make_checkpoint("qwen2", tmp_path / "qwen2", dtype="bfloat16"))
    prompts = _prompts(4)
    tp1 = LLM(path, kv_cache_memory_bytes=16 << 20)
    packed = tp1.engine.executor.worker.packed_bytes
    total = tp1.engine.executor.worker.param_bytes()
    tp1.engine.shutdown()
    tp2, per_rank = _tp2_generate(path, prompts)
    if packed:  # the ranks hold their halves of the packed copies too
        _assert_halves(per_rank, total)
    hf = load_hf(path)
    for prompt, out in zip(prompts, tp2, strict=True):
        ours = out.outputs[0].token_ids
        assert_greedy_match(hf, prompt, ours, hf_greedy(hf, prompt, 10))


def test_tp2_with_prefix_caching_chunking_and_preemption(demo_dir) -> None:
    prefix = _prompts(2, (64,))[0]
    prompts = [prefix + p for p in _prompts(3, (5, 60, 120, 150, 9, 33, 70, 100))]
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    ref = LLM(str(demo_dir), kv_cache_memory_bytes=16 << 20).generate(
        prompts, params, use_tqdm=False
    )
    # 32 KiB per block per rank for the demo model at TP=2: 20 blocks force preemption.
    llm = LLM(
        str(demo_dir),
        tensor_parallel_size=2,
        kv_cache_memory_bytes=20 * 32768,
        max_num_batched_tokens=64,
    )
    try:
        out = llm.generate(prompts, params, use_tqdm=False)
        stats = llm.stats()
    finally:
        llm.engine.shutdown()
    assert [o.outputs[0].token_ids for o in out] == [o.outputs[0].token_ids for o in ref]
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
    assert stats.kv_blocks_used == 0


def test_tp2_host_kv_tier_restores_every_ranks_shard(demo_dir) -> None:
    """Each rank keeps its own shard of the evicted blocks (workers/device/kv_offload.py): the
    shared prefix comes back from both, with TP=1's tokens."""
    from tests.workers.test_kv_offload_engine import GREEDY as SHORT
    from tests.workers.test_kv_offload_engine import PROMPTS

    ref = LLM(str(demo_dir), kv_cache_memory_bytes=16 << 20)
    expected = [ref.generate([p], SHORT, use_tqdm=False)[0].outputs[0].token_ids for p in PROMPTS]
    # 12 blocks of 32 KiB per rank: the prefix does not stay on the device (as at TP=1).
    llm = LLM(
        str(demo_dir), tensor_parallel_size=2, kv_cache_memory_bytes=12 * 32768, kv_offload_gib=0.01
    )
    try:
        out = [llm.generate([p], SHORT, use_tqdm=False)[0].outputs[0].token_ids for p in PROMPTS]
        stats = llm.stats()
    finally:
        llm.engine.shutdown()
    assert out == expected
    assert stats.kv_offload_hit_tokens == 96 and stats.kv_blocks_total == 12
    # The engine's bytes are both ranks' shards: a whole block each.
    assert stats.kv_offload_bytes == stats.kv_offload_blocks * 2 * 32768


def test_tp2_exports_and_imports_every_ranks_shard(demo_dir) -> None:
    """The cluster tier at TP=2 (workers/core/kv_share.py): each exported block carries both
    ranks' shards; after the cache is emptied, the blocks taken back with the request are
    restored on both ranks, with the tokens of the first run."""
    from tests.workers.test_kv_share_engine import GREEDY as SHORT
    from tests.workers.test_kv_share_engine import PROMPT, _exported, _generate_with

    llm = LLM(
        str(demo_dir),
        tensor_parallel_size=2,
        kv_cache_memory_bytes=16 << 20,
        kv_offload_gib=0.01,
        kv_events=True,
        kv_share=True,
    )
    try:
        first = llm.generate([PROMPT], SHORT, use_tqdm=False)[0]
        blocks = _exported(llm)
        llm.engine.block_manager.reset_prefix_cache()
        again = _generate_with(llm, PROMPT, blocks)
        stats = llm.stats()
    finally:
        llm.engine.shutdown()
    assert len(blocks) == 6 and all(len(b.shards) == 2 for b in blocks)
    assert all(b.shards[0].nbytes == 32768 for b in blocks)  # half a block on each rank
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    assert again.num_cached_tokens == 96 and stats.kv_offload_copies_in == 6


def test_tp2_constrained_decoding_matches_tp1(demo_dir) -> None:
    """The grammar bitmask travels to the ranks in the step input; rank 0 applies it."""
    from workers.structured import StructuredOutputs

    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 999}},
        "required": ["n"],
        "additionalProperties": False,
    }
    params = [
        SamplingParams(
            max_tokens=40,
            temperature=t,
            seed=i,
            structured_outputs=StructuredOutputs.from_schema(schema)
            if i % 2
            else StructuredOutputs(regex=r"[a-z]{3,8}( [a-z]{3,8}){2}"),
        )
        for i, t in enumerate((0.0, 0.0, 1.0, 1.0))
    ]
    prompts = _prompts(4, (5, 20, 9, 30))
    ref = LLM(str(demo_dir), kv_cache_memory_bytes=16 << 20).generate(
        prompts, params, use_tqdm=False
    )
    llm = LLM(str(demo_dir), tensor_parallel_size=2, kv_cache_memory_bytes=16 << 20)
    try:
        out = llm.generate(prompts, params, use_tqdm=False)
    finally:
        llm.engine.shutdown()
    assert [o.outputs[0].text for o in out] == [o.outputs[0].text for o in ref]
    assert all(o.outputs[0].finish_reason == "stop" for o in out)


def test_killing_a_rank_fails_every_request_quickly(demo_dir) -> None:
    eng = AsyncEngine(
        EngineArgs(
            model=str(demo_dir),
            tensor_parallel_size=2,
            kv_cache_memory_bytes=16 << 20,
            step_timeout_s=10,
        )
    )
    params = SamplingParams(max_tokens=2000, temperature=0.0, ignore_eos=True)
    results = fail_while_streaming(
        eng, params, lambda: ray.kill(eng.engine.executor.actors[1]), after_tokens=40
    )
    assert all(isinstance(r, EngineDeadError) for r in results), results
    assert any("rank" in str(r) for r in results)
    assert not eng.healthy
    assert eng.engine.executor.actors == []  # actors and placement group released
    eng.shutdown()


def test_tp3_on_four_heads_is_a_clear_startup_error(checkpoints) -> None:
    with pytest.raises(
        ValueError,
        match=r"num_attention_heads \(4\) is not divisible by "
        r"tensor_parallel_size \(3\)",
    ):
        LLM(str(checkpoints["llama"]), tensor_parallel_size=3)

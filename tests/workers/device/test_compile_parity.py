"""The compiled forward pass (workers/device/compile.py) changes no output: greedy parity with
transformers on every supported family, and the engine's preemption, chunked prefill,
prefix caching and seeded sampling give the eager engine's tokens.

Kept small on purpose (compiling is the slow part): tiny models, two graphs each. The
parity tests compile every step (compile_min_tokens=1); by default small CPU steps run
eagerly, which the last test checks."""

from __future__ import annotations

import random

import pytest

from tests.checkpoints import KINDS, hf_greedy, load_hf
from tests.workers.parity import assert_greedy_match
from workers import LLM, SamplingParams
from workers.compile_sizes import CPU_COMPILED_MIN_TOKENS

# Around block (16) boundaries; the longest prompts are chunked (max_num_batched_tokens 64).
LENGTHS = [1, 2, 15, 16, 17, 33, 64, 100, 129, 200]
MAX_TOKENS = 8


def _compiled(llm: LLM) -> bool:
    return llm.engine.executor.timing().get("compile_s", 0) > 0


@pytest.mark.parametrize("kind", KINDS)
def test_compiled_greedy_matches_transformers(kind: str, checkpoints) -> None:
    path = checkpoints[kind]
    llm = LLM(
        str(path),
        kv_cache_memory_bytes=16 << 20,
        compile=True,
        compile_min_tokens=1,
        max_num_batched_tokens=64,
    )
    assert _compiled(llm)
    rng = random.Random(3)
    prompts = [[rng.randrange(3, llm.engine.vocab_size) for _ in range(n)] for n in LENGTHS]
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    hf = load_hf(path)
    exact = 0
    for prompt, out in zip(prompts, outs, strict=True):
        ours = out.outputs[0].token_ids
        assert len(ours) == MAX_TOKENS
        exact += assert_greedy_match(hf, prompt, ours, hf_greedy(hf, prompt, MAX_TOKENS))
    assert exact >= len(prompts) - 1


def test_compiled_engine_under_preemption_prefix_caching_and_seeds(demo_dir) -> None:
    rng = random.Random(5)
    prefix = [rng.randrange(3, 3000) for _ in range(32)]
    prompts = [prefix + [rng.randrange(3, 3000) for _ in range(20 + 9 * i)] for i in range(8)]
    params = [
        SamplingParams(max_tokens=24, ignore_eos=True, temperature=0.0)
        if i % 2
        else SamplingParams(max_tokens=24, ignore_eos=True, temperature=1.0, seed=i)
        for i in range(8)
    ]
    eager = LLM(str(demo_dir), kv_cache_memory_bytes=16 << 20)
    expected = [o.outputs[0].token_ids for o in eager.generate(prompts, params, use_tqdm=False)]
    # 64 KiB per demo block: 24 blocks (384 tokens) for 8 sequences of ~110 -> preemption;
    # 64-token steps chunk every prompt's prefill.
    tight = LLM(
        str(demo_dir),
        kv_cache_memory_bytes=24 * 65536,
        max_num_batched_tokens=64,
        compile=True,
        compile_min_tokens=1,
    )
    assert _compiled(tight)
    got = [o.outputs[0].token_ids for o in tight.generate(prompts, params, use_tqdm=False)]
    assert got == expected
    stats = tight.stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
    assert stats.kv_blocks_used == 0


def test_by_default_only_large_cpu_steps_run_compiled(demo_dir) -> None:
    rng = random.Random(7)
    prompts = [[rng.randrange(3, 3000) for _ in range(n)] for n in (300, 40)]
    params = SamplingParams(max_tokens=6, ignore_eos=True, temperature=0.0)
    eager = LLM(str(demo_dir), kv_cache_memory_bytes=16 << 20, max_num_batched_tokens=256)
    expected = [o.outputs[0].token_ids for o in eager.generate(prompts, params, use_tqdm=False)]
    llm = LLM(
        str(demo_dir), kv_cache_memory_bytes=16 << 20, max_num_batched_tokens=256, compile=True
    )
    assert _compiled(llm)
    compiled = llm.engine.executor.worker.forward.compiled
    assert compiled.config.min_tokens == CPU_COMPILED_MIN_TOKENS
    steps: list[int] = []
    pre = compiled.pre

    def counting_pre(layer, positions, x):  # noqa: ANN001, ANN202
        steps.append(x.shape[0])
        return pre(layer, positions, x)

    compiled.pre = counting_pre
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == expected
    # Steps: 256 prefill tokens (compiled), then 44 + 40 + 1 decode (84: eager), then decodes
    # of 2 tokens (eager). Only the first step's layers ran the compiled pieces.
    assert steps == [256] * len(llm.engine.executor.worker.model.layers)


def test_compiled_bfloat16_checkpoint_reads_only_the_packed_copies(tmp_path) -> None:
    # The compiled pieces call the kernels as custom ops (`kvray::linear` routes each step by
    # its rows), as the eager steps do: one copy of each weight, the packed bfloat16 one
    # (workers/device/layers/cpu_kernels/apply.py use_cpu_kernels).
    from tests.checkpoints import make_checkpoint

    path = make_checkpoint("qwen3", tmp_path / "qwen3", dtype="bfloat16")
    llm = LLM(str(path), kv_cache_memory_bytes=16 << 20, compile=True)
    assert _compiled(llm)
    worker = llm.engine.executor.worker
    model = worker.model
    qkv = model.layers[0].self_attn.qkv_proj
    if worker.cpu_kernel is not None:  # kernels on (32-byte vectors or wider)
        assert qkv.packed_weight is not None and qkv.weight.is_meta
    compiled_steps: list[int] = []
    compiled = worker.forward.compiled
    pre = compiled.pre

    def counting_pre(layer, positions, x):  # noqa: ANN001, ANN202
        compiled_steps.append(x.shape[0])
        return pre(layer, positions, x)

    compiled.pre = counting_pre
    rng = random.Random(4)
    prompts = [[rng.randrange(3, llm.engine.vocab_size) for _ in range(n)] for n in LENGTHS]
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert compiled_steps  # the prefill step ran compiled, the decode steps eagerly
    hf = load_hf(path)
    exact = sum(
        assert_greedy_match(hf, p, o.outputs[0].token_ids, hf_greedy(hf, p, MAX_TOKENS))
        for p, o in zip(prompts, outs, strict=True)
    )
    assert exact >= len(prompts) - 1

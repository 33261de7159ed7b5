"""Greedy tokens and logprobs identical to transformers (float32, CPU) on every family."""

from __future__ import annotations

import random

import pytest
import torch

from tests.checkpoints import KINDS, hf_greedy, hf_logprobs, load_hf, make_checkpoint
from tests.workers.kernel_builds import avx2_build
from tests.workers.parity import assert_greedy_match
from workers import LLM, SamplingParams
from workers.device.layers.cpu_kernels import amx, amx_packed, tiled_kernels

# 24 prompt lengths from 1 to 300, around block (16) boundaries on purpose.
LENGTHS = [
    1,
    2,
    3,
    5,
    8,
    13,
    15,
    16,
    17,
    31,
    32,
    33,
    47,
    64,
    65,
    100,
    127,
    128,
    129,
    160,
    200,
    255,
    257,
    300,
]
MAX_TOKENS = 12


def _prompts(vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in LENGTHS]


@pytest.mark.parametrize("kind", KINDS)
def test_greedy_batch_matches_transformers(kind: str, checkpoints) -> None:
    path = checkpoints[kind]
    llm = LLM(str(path), kv_cache_memory_bytes=32 << 20)
    prompts = _prompts(llm.engine.vocab_size)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)  # ONE batch
    hf = load_hf(path)
    exact = 0
    for prompt, out in zip(prompts, outs, strict=True):
        ours = out.outputs[0].token_ids
        assert len(ours) == MAX_TOKENS and out.outputs[0].finish_reason == "length"
        exact += assert_greedy_match(hf, prompt, ours, hf_greedy(hf, prompt, MAX_TOKENS))
    # Ties are rare with these weight scales; most prompts must match exactly.
    assert exact >= len(prompts) - 2
    assert llm.stats().kv_blocks_used == 0


def test_sharded_checkpoint_and_both_config_spellings(tmp_path) -> None:
    outs = []
    for spelling in ("old", "new"):
        path = make_checkpoint("llama", tmp_path / spelling, sharded=True, config_spelling=spelling)
        llm = LLM(str(path), kv_cache_memory_bytes=16 << 20)
        prompt = _prompts(llm.engine.vocab_size, seed=1)[20]
        params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
        outs.append(llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids)
        hf = load_hf(path)
        assert_greedy_match(hf, prompt, outs[-1], hf_greedy(hf, prompt, 8))
    assert outs[0] == outs[1]


@pytest.mark.parametrize("kind", ["qwen3", "llama"])
def test_logprobs_match_transformers(kind: str, checkpoints) -> None:
    path = checkpoints[kind]
    llm = LLM(str(path), kv_cache_memory_bytes=16 << 20)
    prompts = _prompts(llm.engine.vocab_size, seed=2)[::6]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=5)
    outs = llm.generate(prompts, params, use_tqdm=False)
    hf = load_hf(path)
    for prompt, out in zip(prompts, outs, strict=True):
        comp = out.outputs[0]
        rows = hf_logprobs(hf, prompt, comp.token_ids)
        assert comp.logprobs is not None and len(comp.logprobs) == len(comp.token_ids)
        for row, tok, lp in zip(rows, comp.token_ids, comp.logprobs, strict=True):
            assert abs(lp[tok] - row[tok].item()) < 1e-4
            top = torch.topk(row, 5)
            for tid, val in zip(top.indices.tolist(), top.values.tolist(), strict=True):
                assert tid in lp and abs(lp[tid] - val) < 1e-4


# qwen2: biases on q/k/v; avx2: the kernels' register tiles for 32-byte vectors.
@pytest.mark.parametrize(("kind", "build"), [("qwen2", ""), ("qwen3", ""), ("qwen3", "avx2")])
def test_a_bfloat16_checkpoint_served_in_float32_matches_transformers(
    kind: str, build: str, tmp_path, monkeypatch
) -> None:
    # On CPU the linears then read packed bfloat16 copies of the weights (exact values, half
    # the bytes): the tokens must stay transformers' float32 tokens. Long prompts make
    # prefill steps of more rows than BF16_MAX_ROWS.
    if build == "avx2":
        from workers.device.layers.cpu_kernels import build as cpu_kernels

        lib = avx2_build()
        monkeypatch.setattr(cpu_kernels, "kernel", lambda: lib)
    path = make_checkpoint(kind, tmp_path / kind, dtype="bfloat16")
    llm = LLM(str(path), kv_cache_memory_bytes=16 << 20, dtype="float32")
    worker = llm.engine.executor.worker
    # The copies exist where the bfloat16 kernel is used: builds it has register tiles for.
    assert build != "avx2" or worker.cpu_kernel is lib
    if worker.cpu_kernel is not None and tiled_kernels(worker.cpu_kernel):
        model = worker.model
        assert model.lm_head.packed_weight is not None
        assert model.layers[0].self_attn.qkv_proj.packed_weight is not None
        # Freed float32 weights (not compiled): every step reads the copies; a tied LM head
        # keeps the embedding's.
        assert model.layers[0].self_attn.qkv_proj.weight.is_meta
        assert model.lm_head.weight.is_meta != model.config.tie_word_embeddings
        # With AMX (CPU and build) they are laid out for, and run on, its tiles.
        on_amx = amx(worker.cpu_kernel)
        assert amx_packed(model.layers[0].self_attn.qkv_proj.packed_weight) == on_amx
        assert build != "avx2" or not on_amx
    prompts = _prompts(llm.engine.vocab_size, seed=3)[::2]
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    hf = load_hf(path)
    exact = sum(
        assert_greedy_match(hf, p, o.outputs[0].token_ids, hf_greedy(hf, p, MAX_TOKENS))
        for p, o in zip(prompts, outs, strict=True)
    )
    assert exact >= len(prompts) - 1
    llm.engine.shutdown()

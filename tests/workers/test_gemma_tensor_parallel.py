"""Gemma 3 at TP = 2 (gloo, Ray worker actors): Llama's splits (heads, MLP width, vocab; one KV
head replicated), the same tokens as TP = 1 and transformers, logprobs to 1e-4."""

from __future__ import annotations

import random

import pytest

from tests.checkpoints import hf_greedy, hf_logprobs, load_hf
from tests.gemma_checkpoints import make_gemma_checkpoint
from tests.workers.parity import assert_greedy_match
from workers import LLM, SamplingParams

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=3)
CASES = {
    "new-gqa": {},  # two KV heads: one per rank
    "old-mqa": {"spelling": "old", "num_kv_heads": 1},  # one KV head: replicated on both
}


@pytest.fixture(scope="module", autouse=True)
def ray_cluster(ray_session: object) -> None:
    """The TP ranks run as actors of the session's Ray instance (tests/conftest.py)."""


@pytest.mark.parametrize("name", CASES)
def test_tp2_matches_tp1_and_transformers(name: str, tmp_path) -> None:
    path = str(make_gemma_checkpoint(tmp_path / name, **CASES[name]))
    rng = random.Random(7)
    prompts = [[rng.randrange(3, 3800) for _ in range(n)] for n in (1, 7, 16, 33, 90, 200)]
    tp1 = LLM(path, kv_cache_memory_bytes=16 << 20)
    total = tp1.engine.executor.worker.param_bytes()
    ref = tp1.generate(prompts, GREEDY, use_tqdm=False)
    tp1.engine.shutdown()
    llm = LLM(path, tensor_parallel_size=2, kv_cache_memory_bytes=16 << 20)
    try:
        tp2 = llm.generate(prompts, GREEDY, use_tqdm=False)
        per_rank = llm.engine.executor.param_bytes()
    finally:
        llm.engine.shutdown()
    # Vocab-parallel (tied) embedding, column/row-parallel linears: about half each; the
    # norms, and a single KV head's k/v rows, are replicated.
    for b in per_rank:
        assert abs(b - total / 2) / (total / 2) < 0.08, (per_rank, total)
    hf = load_hf(path)
    for prompt, a, b in zip(prompts, ref, tp2, strict=True):
        ta, tb = a.outputs[0].token_ids, b.outputs[0].token_ids
        assert_greedy_match(hf, prompt, tb, ta)
        assert_greedy_match(hf, prompt, tb, hf_greedy(hf, prompt, 10))
        rows = hf_logprobs(hf, prompt, tb)
        for row, tok, lp in zip(rows, tb, b.outputs[0].logprobs, strict=True):
            assert abs(lp[tok] - row[tok].item()) < 1e-4

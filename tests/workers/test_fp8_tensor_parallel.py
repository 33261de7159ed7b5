"""FP8 block-scaled checkpoints and int8 W8A16 ones (per channel, per group) at TP = 2 (gloo,
Ray worker actors): each rank holds half of every quantized weight and of its scales, and
serves the same tokens as TP = 1 and as transformers' own loading of the checkpoint. The
sharding itself, Ray-free: tests/workers/device/test_loader.py."""

from __future__ import annotations

import random

import pytest

from tests.checkpoints import hf_greedy
from tests.compressed_tensors_checkpoints import INT8_STRATEGIES, load_hf_ct, make_int8_checkpoint
from tests.fp8_checkpoints import FP8_KINDS, load_hf_fp8, make_fp8_checkpoint
from tests.workers.parity import assert_greedy_match
from workers import LLM, SamplingParams

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module", autouse=True)
def ray_cluster(ray_session: object) -> None:
    """The TP ranks run as actors of the session's Ray instance (tests/conftest.py)."""


INT8_KINDS = tuple(f"int8-{s}" for s in INT8_STRATEGIES)


@pytest.mark.parametrize("kind", [*FP8_KINDS, *INT8_KINDS])
def test_tp2_matches_tp1_and_transformers(kind: str, tmp_path) -> None:
    if kind in INT8_KINDS:
        strategy = kind.removeprefix("int8-")
        path, load_hf = str(make_int8_checkpoint(strategy, tmp_path / kind)), load_hf_ct
    else:
        path, load_hf = str(make_fp8_checkpoint(kind, tmp_path / kind)), load_hf_fp8
    rng = random.Random(11)
    prompts = [[rng.randrange(3, 3800) for _ in range(n)] for n in (1, 9, 33, 70)]
    tp1 = LLM(path, kv_cache_memory_bytes=16 << 20)
    projections = sum(
        p.nbytes
        for n, p in tp1.engine.executor.worker.model.layers.named_parameters()
        if "_proj." in n or ".w13" in n or ".w2" in n
    )
    total = tp1.engine.executor.worker.param_bytes()
    ref = tp1.generate(prompts, GREEDY, use_tqdm=False)
    tp1.engine.shutdown()
    # A generous step bound: the ranks share this machine's CPUs with the rest of the suite.
    llm = LLM(path, tensor_parallel_size=2, kv_cache_memory_bytes=16 << 20, step_timeout_s=60)
    try:
        tp2 = llm.generate(prompts, GREEDY, use_tqdm=False)
        per_rank = llm.engine.executor.param_bytes()
    finally:
        llm.engine.shutdown()
    # Each rank holds half of every projection (FP8 and scales) and of the vocabulary.
    for b in per_rank:
        assert abs(b - total / 2) < 0.01 * total, (per_rank, total, projections)
    hf = load_hf(path)
    for prompt, a, b in zip(prompts, ref, tp2, strict=True):
        ta, tb = a.outputs[0].token_ids, b.outputs[0].token_ids
        assert_greedy_match(hf, prompt, tb, ta)
        assert_greedy_match(hf, prompt, tb, hf_greedy(hf, prompt, 8))

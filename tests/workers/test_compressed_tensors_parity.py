"""compressed-tensors FP8 checkpoints (per-channel, per-tensor and 128x128-block weight
scales; tests/compressed_tensors_checkpoints.py) served by the engine: greedy tokens and their
logprobs identical, in float32, to transformers' own loading of the same checkpoint through
the compressed-tensors package (weights decompressed at load), never to our own dequantizer;
the projections kept FP8 in memory. Each TP rank's shard of weights and scales:
tests/workers/device/test_loader.py."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from tests.compressed_tensors_checkpoints import STRATEGIES, load_hf_ct, make_ct_checkpoint
from tests.workers.parity import assert_greedy_and_logprobs_match
from workers import LLM, SamplingParams

MAX_TOKENS = 10
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logprobs=1)
LENGTHS = [1, 5, 17, 40]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("ct")
    return {s: make_ct_checkpoint(s, root / s) for s in STRATEGIES}


def _prompts() -> list[list[int]]:
    rng = random.Random(5)
    return [[rng.randrange(3, 3800) for _ in range(n)] for n in LENGTHS]


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_greedy_and_logprobs_match_transformers(strategy: str, checkpoints: dict) -> None:
    path = checkpoints[strategy]
    prompts = _prompts()
    llm = LLM(str(path), kv_cache_memory_bytes=16 << 20)
    try:
        quant = llm.engine.config.model.quantization
        assert quant is not None and (quant.method, quant.strategy) == (
            "compressed-tensors",
            strategy,
        )
        outs = llm.generate(prompts, GREEDY, use_tqdm=False)
        worker = llm.engine.executor.worker
        proj = worker.model.layers[0].self_attn.qkv_proj
        assert proj.weight.element_size() == 1  # kept FP8 in memory
    finally:
        llm.engine.shutdown()
    assert_greedy_and_logprobs_match(load_hf_ct(path), prompts, outs, MAX_TOKENS)

"""compressed-tensors FP8 checkpoints (per-channel, per-tensor and 128x128-block weight
scales; tests/compressed_tensors_checkpoints.py) served by the engine: greedy tokens and their
logprobs identical, in float32, to transformers' own loading of the same checkpoint through
the compressed-tensors package (weights decompressed at load), never to our own dequantizer;
the projections kept FP8 in memory. Likewise int8 W8A16 checkpoints (per-channel and per-group
scales), on the dequantizing path and on CPU's int8 GEMM. Each TP rank's shard of weights and
scales: tests/workers/device/test_loader.py."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from tests.compressed_tensors_checkpoints import (
    INT8_STRATEGIES,
    STRATEGIES,
    load_hf_ct,
    make_ct_checkpoint,
    make_int8_checkpoint,
)
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


# int8 weight-only (W8A16): the dequantizing reference path (group scales always; channel
# scales with cpu_kernels off) must match transformers' float32 dequantize=True loading as the
# FP8 checkpoints do; the fast path (torch._weight_int8pack_mm, CPU, per channel) the same
# greedy tokens, its logprobs within FAST_TOL of transformers'.
FAST_TOL = 1e-3  # the scale applied after the float32 dot product (measured: < 1e-4)


@pytest.fixture(scope="module")
def int8_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("ct-int8")
    return {s: make_int8_checkpoint(s, root / s) for s in INT8_STRATEGIES}


@pytest.mark.parametrize(
    ("strategy", "fast"), [("channel", False), ("group", False), ("channel", True)]
)
def test_int8_greedy_and_logprobs_match_transformers(
    strategy: str, fast: bool, int8_checkpoints: dict
) -> None:
    path = int8_checkpoints[strategy]
    prompts = _prompts()
    llm = LLM(str(path), kv_cache_memory_bytes=16 << 20, cpu_kernels=fast)
    try:
        quant = llm.engine.config.model.quantization
        assert quant is not None and (quant.weights, quant.strategy) == ("int8", strategy)
        outs = llm.generate(prompts, GREEDY, use_tqdm=False)
        layer = llm.engine.executor.worker.model.layers[0]
        for proj in (layer.self_attn.qkv_proj, layer.mlp.down_proj):
            assert proj.weight.dtype == torch.int8  # kept int8 in memory
            assert proj.uses_fast_path(torch.float32) is fast
    finally:
        llm.engine.shutdown()
    tol = FAST_TOL if fast else 1e-4
    assert_greedy_and_logprobs_match(load_hf_ct(path), prompts, outs, MAX_TOKENS, tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_fast_path_is_the_reference_up_to_rounding(dtype: torch.dtype) -> None:
    """One layer: torch's int8 GEMM against dequantize-then-matmul, in float32 and bfloat16,
    within a relative tolerance of the output's scale (bfloat16: its own rounding)."""
    from tests.compressed_tensors_checkpoints import quantize_int8
    from workers.device.distributed import TPGroup
    from workers.device.layers.int8_linear import Int8ColumnParallelLinear
    from workers.quantization import QuantizationConfig

    torch.manual_seed(0)
    quant = QuantizationConfig(method="compressed-tensors", strategy="channel", weights="int8")
    layer = Int8ColumnParallelLinear(256, [96, 32], True, TPGroup(), dtype, quant)
    q, s = quantize_int8(torch.randn(128, 256) * 0.05, "channel")
    layer.weight.data.copy_(q)
    layer.weight_scale.data.copy_(s)
    layer.bias.data.copy_(torch.randn(128).to(dtype))
    for rows in (1, 7, 64):
        x = torch.randn(rows, 256, dtype=dtype)
        assert layer.uses_fast_path(dtype)
        fast = layer(x)
        layer.fast_path = False
        ref = layer(x)
        layer.fast_path = True
        scale = ref.float().abs().max().item()
        rel = 1e-5 if dtype == torch.float32 else 2e-2
        assert (fast.float() - ref.float()).abs().max().item() <= rel * scale, (rows, dtype)

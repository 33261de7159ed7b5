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


# int8 weight-only (W8A16): the dequantizing reference path must match transformers' float32
# dequantize=True loading as the FP8 checkpoints do, per channel and per group, fast path on or
# off (in float32 it is never taken). The fast path (torch._weight_int8pack_mm: CPU, per
# channel, bfloat16, decode-sized steps) is held to the reference path in bfloat16: the same
# greedy tokens, logprobs within FAST_TOL.
FAST_TOL = 0.15  # bfloat16 logits: ~2 ulps at magnitude 8-16 (measured max 0.063)


@pytest.fixture(scope="module")
def int8_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("ct-int8")
    return {s: make_int8_checkpoint(s, root / s) for s in INT8_STRATEGIES}


def _int8_run(path: Path, prompts: list, **kwargs) -> tuple[list, list[bool]]:
    """Outputs of an engine over `path`, and whether its projections take the fast path for a
    decode step of 4 rows in the engine's dtype."""
    llm = LLM(str(path), kv_cache_memory_bytes=16 << 20, **kwargs)
    try:
        quant = llm.engine.config.model.quantization
        assert quant is not None and quant.weights == "int8"
        outs = llm.generate(prompts, GREEDY, use_tqdm=False)
        layer = llm.engine.executor.worker.model.layers[0]
        dtype = llm.engine.config.torch_dtype
        fast = []
        for proj in (layer.self_attn.qkv_proj, layer.mlp.down_proj):
            assert proj.weight.dtype == torch.int8  # kept int8 in memory
            fast.append(proj.uses_fast_path(dtype, 4))
    finally:
        llm.engine.shutdown()
    return outs, fast


@pytest.mark.parametrize("strategy", INT8_STRATEGIES)
def test_int8_greedy_and_logprobs_match_transformers(strategy: str, int8_checkpoints: dict) -> None:
    path = int8_checkpoints[strategy]
    prompts = _prompts()
    outs, fast = _int8_run(path, prompts)
    assert fast == [False, False]  # float32: the reference path
    assert_greedy_and_logprobs_match(load_hf_ct(path), prompts, outs, MAX_TOKENS)


def test_int8_fast_path_matches_the_reference_path_in_bfloat16(int8_checkpoints: dict) -> None:
    path = int8_checkpoints["channel"]
    prompts = _prompts()
    ref, ref_fast = _int8_run(path, prompts, dtype="bfloat16", cpu_kernels=False)
    outs, fast = _int8_run(path, prompts, dtype="bfloat16")
    assert (ref_fast, fast) == ([False, False], [True, True])
    for a, b in zip(ref, outs, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for tok, la, lb in zip(
            a.outputs[0].token_ids, a.outputs[0].logprobs, b.outputs[0].logprobs, strict=True
        ):
            assert abs(la[tok] - lb[tok]) < FAST_TOL, (tok, la[tok], lb[tok])


def test_int8_fast_path_is_the_reference_up_to_rounding() -> None:
    """One layer: torch's int8 GEMM against dequantize-then-matmul in bfloat16, within
    bfloat16's rounding of the output's scale; float32, per-group scales and big steps keep
    the reference."""
    from tests.compressed_tensors_checkpoints import quantize_int8
    from workers.device.distributed import TPGroup
    from workers.device.layers.int8_linear import FAST_MAX_ROWS, Int8ColumnParallelLinear
    from workers.quantization import QuantizationConfig

    torch.manual_seed(0)
    dtype = torch.bfloat16
    quant = QuantizationConfig(method="compressed-tensors", strategy="channel", weights="int8")
    layer = Int8ColumnParallelLinear(256, [96, 32], True, TPGroup(), dtype, quant)
    q, s = quantize_int8(torch.randn(128, 256) * 0.05, "channel")
    layer.weight.data.copy_(q)
    layer.weight_scale.data.copy_(s)
    layer.bias.data.copy_(torch.randn(128).to(dtype))
    for rows in (1, 7, FAST_MAX_ROWS):
        x = torch.randn(rows, 256, dtype=dtype)
        assert layer.uses_fast_path(dtype, rows)
        fast = layer(x)
        layer.fast_path = False
        ref = layer(x)
        layer.fast_path = True
        scale = ref.float().abs().max().item()
        assert (fast.float() - ref.float()).abs().max().item() <= 2e-2 * scale, rows
    assert not layer.uses_fast_path(dtype, FAST_MAX_ROWS + 1)
    assert not layer.uses_fast_path(torch.float32, 1)
    group = QuantizationConfig(
        method="compressed-tensors", strategy="group", weights="int8", weight_block_size=(1, 128)
    )
    assert not Int8ColumnParallelLinear(256, [128], False, TPGroup(), dtype, group).uses_fast_path(
        dtype, 1
    )

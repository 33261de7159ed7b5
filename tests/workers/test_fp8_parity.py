"""FP8 block-scaled checkpoints (Qwen3, Qwen3-MoE; tests/fp8_checkpoints.py) served by the
engine: greedy tokens and their logprobs identical, in float32, to transformers' own loading
of the same checkpoint (its FineGrainedFP8 quantizer dequantizing at load), never to our own
dequantizer; and the projections' bytes a quarter of float32's, half of bfloat16's.
TP = 2: test_fp8_tensor_parallel.py; bad files: tests/workers/device/test_loader.py."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.fp8_checkpoints import FP8_KINDS, load_hf_fp8, make_fp8_checkpoint
from tests.workers.parity import assert_greedy_and_logprobs_match
from workers import LLM, SamplingParams

MAX_TOKENS = 10
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logprobs=1)
LENGTHS = [1, 5, 16, 17, 40, 100]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("fp8")
    return {kind: make_fp8_checkpoint(kind, root / kind) for kind in FP8_KINDS}


@pytest.mark.parametrize("kind", FP8_KINDS)
def test_greedy_and_logprobs_match_transformers(kind: str, checkpoints: dict[str, Path]) -> None:
    path = checkpoints[kind]
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 3800) for _ in range(n)] for n in LENGTHS]
    llm = LLM(str(path), kv_cache_memory_bytes=16 << 20)
    try:
        assert llm.engine.config.model.quantization is not None
        outs = llm.generate(prompts, GREEDY, use_tqdm=False)
        again = llm.generate(prompts[-2:], GREEDY, use_tqdm=False)  # from the prefix cache
    finally:
        llm.engine.shutdown()
    assert_greedy_and_logprobs_match(load_hf_fp8(path), prompts, outs, MAX_TOKENS)
    for a, b in zip(outs[-2:], again, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids


def _projection_bytes(llm: Any) -> int:
    """Bytes of the attention and MLP projections (experts included) and their scales."""
    model = llm.engine.executor.worker.model
    names = ("_proj.", ".w13", ".w2")
    return sum(
        p.numel() * p.element_size()
        for n, p in model.layers.named_parameters()
        if any(s in n for s in names)
    )


@pytest.mark.parametrize("kind", FP8_KINDS)
def test_weight_bytes(kind: str, checkpoints: dict[str, Path], tmp_path: Path) -> None:
    """The projections in FP8 take a quarter of their float32 bytes and half of bfloat16's
    (plus one float32 scale per 128x128 block: 1/4096 more); the whole model less too."""
    full = make_fp8_checkpoint(kind, tmp_path / kind, quantize=False)
    sizes, totals = {}, {}
    for name, path, dtype in [
        ("fp8", checkpoints[kind], "auto"),
        ("float32", full, "float32"),
        ("bfloat16", full, "bfloat16"),
    ]:
        llm = LLM(str(path), dtype=dtype, kv_cache_memory_bytes=4 << 20, cpu_kernels=False)
        try:
            sizes[name] = _projection_bytes(llm)
            totals[name] = llm.engine.executor.worker.param_bytes()
        finally:
            llm.engine.shutdown()
    scales = 4 / (128 * 128)
    assert sizes["fp8"] == pytest.approx(sizes["float32"] * (1 + scales) / 4, rel=1e-6)
    assert sizes["fp8"] == pytest.approx(sizes["bfloat16"] * (1 + scales) / 2, rel=1e-6)
    assert totals["fp8"] < totals["float32"] - 0.7 * sizes["float32"]


def test_fp8_engine_runs_in_bfloat16(checkpoints: dict[str, Path]) -> None:
    """The weights dequantize into the engine's dtype: bfloat16 serves too (tokens not held to
    float32's: rounding differs)."""
    llm = LLM(str(checkpoints["qwen3"]), dtype="bfloat16", kv_cache_memory_bytes=4 << 20)
    try:
        out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, temperature=0.0))
        layer = llm.engine.executor.worker.model.layers[0]
        assert layer.self_attn.qkv_proj.weight.dtype == torch.float8_e4m3fn
        assert layer.input_layernorm.weight.dtype == torch.bfloat16
    finally:
        llm.engine.shutdown()
    assert len(out[0].outputs[0].token_ids) == 4

"""compressed-tensors int4 W4A16 checkpoints (pack-quantized: per group, per channel, and
asymmetric per group with zero points; quantized and packed by the compressed-tensors package,
tests/int4_checkpoints.py) served by the engine: greedy tokens and their logprobs identical,
in float32, to transformers' own loading of the same checkpoint through the compressed-tensors
package (weights decompressed at load), never to our own dequantizer; the projections kept
packed, half a byte per weight. CPU's 4-bit GEMM (the fast path, bfloat16 decode steps) is
held to the reference path in bfloat16. Each TP rank's shard: tests/workers/device/
test_int4_loader.py."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from tests.compressed_tensors_checkpoints import load_hf_ct
from tests.int4_checkpoints import W4A16_STRATEGIES, make_w4a16_checkpoint
from tests.workers.parity import assert_greedy_and_logprobs_match
from workers import LLM, SamplingParams

MAX_TOKENS = 10
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logprobs=1)
LENGTHS = [1, 5, 17, 40]
FAST_TOL = 0.15  # bfloat16 logits: ~2 ulps at magnitude 8-16 (as the int8 fast path's)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("ct-int4")
    return {s: make_w4a16_checkpoint(s, root / s) for s in W4A16_STRATEGIES}


def _prompts() -> list[list[int]]:
    rng = random.Random(5)
    return [[rng.randrange(3, 3800) for _ in range(n)] for n in LENGTHS]


def _run(
    path: Path, prompts: list, params: SamplingParams = GREEDY, **kwargs
) -> tuple[list, list[bool]]:
    """Outputs of an engine over `path`, and whether its projections take the fast path for a
    decode step of 4 rows in the engine's dtype."""
    llm = LLM(str(path), kv_cache_memory_bytes=16 << 20, **kwargs)
    try:
        quant = llm.engine.config.model.quantization
        assert quant is not None and quant.weights == "int4"
        outs = llm.generate(prompts, params, use_tqdm=False)
        layer = llm.engine.executor.worker.model.layers[0]
        dtype = llm.engine.config.torch_dtype
        fast = []
        for proj in (layer.self_attn.qkv_proj, layer.mlp.down_proj):
            # Kept packed: eight 4-bit weights per int32, no full-precision copy.
            assert proj.weight_packed.dtype == torch.int32
            assert proj.weight_packed.numel() * 8 == proj.in_features * sum(proj.output_sizes)
            assert not hasattr(proj, "weight")
            fast.append(proj.uses_fast_path(dtype, 4))
    finally:
        llm.engine.shutdown()
    return outs, fast


@pytest.mark.parametrize("strategy", W4A16_STRATEGIES)
def test_int4_greedy_and_logprobs_match_transformers(strategy: str, checkpoints: dict) -> None:
    path = checkpoints[strategy]
    prompts = _prompts()
    outs, fast = _run(path, prompts)
    assert fast == [False, False]  # float32: the reference path
    assert_greedy_and_logprobs_match(load_hf_ct(path), prompts, outs, MAX_TOKENS)


# In bfloat16 the two paths round differently (the kernel scales after its dot products), so a
# near-tie may break either way: steps agree until the first different token, and there the
# reference's token must be the fast path's runner-up within FAST_TOL (a tie in bfloat16).
TOP2 = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logprobs=2)


@pytest.mark.parametrize("strategy", ["group", "group-asym", "channel"])
def test_int4_fast_path_matches_the_reference_path_in_bfloat16(
    strategy: str, checkpoints: dict
) -> None:
    path = checkpoints[strategy]
    prompts = _prompts()
    ref, ref_fast = _run(path, prompts, dtype="bfloat16", cpu_kernels=False, params=TOP2)
    outs, fast = _run(path, prompts, dtype="bfloat16", params=TOP2)
    assert (ref_fast, fast) == ([False, False], [True, True])
    agreed = 0
    for a, b in zip(ref, outs, strict=True):
        steps = zip(
            a.outputs[0].token_ids,
            b.outputs[0].token_ids,
            a.outputs[0].logprobs,
            b.outputs[0].logprobs,
            strict=True,
        )
        for ta, tb, la, lb in steps:
            if ta != tb:
                assert ta in lb and abs(lb[ta] - lb[tb]) < FAST_TOL, (ta, tb, la, lb)
                break
            assert abs(la[ta] - lb[tb]) < FAST_TOL, (ta, la[ta], lb[tb])
            agreed += 1
    assert agreed >= len(prompts) * MAX_TOKENS // 2  # mostly the same tokens

"""The FP8 KV cache (`kv_cache_dtype="fp8"`, workers/device/layers/kv_quant.py) against an
exact emulation in transformers: its own Qwen3 in float32 whose attention rounds every K and
V (after RoPE) to float8 e4m3 and back, with the layer's scales, as the cache holds them. The
engine's greedy tokens must be the emulation's, whatever the chunking, the prefix cache and
the host tier do; its KV cache holds four times the tokens of a float32 one in the same bytes.
The Triton kernels' FP8 path: tests/workers/device/layers/test_triton_attention.py."""

from __future__ import annotations

import random
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.checkpoints import hf_greedy, load_hf
from tests.workers.parity import assert_greedy_and_logprobs_match, assert_greedy_match
from workers import LLM, SamplingParams
from workers.device.layers import kv_quant

MAX_TOKENS = 12
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logprobs=1)
# The chosen tokens' logprobs against the emulation's. Sums in another float32 order put a K
# or V value near an e4m3 rounding boundary on the other side of it now and then (a step of
# 1/16 of it): over a 90-token prompt that moved a logprob by up to 6e-3 here. Storing the
# cache in float32 instead moves them by 0.3 to 3.
LOGPROB_TOL = 2e-2
LENGTHS = [1, 7, 16, 33, 90]
ATTN = "kvray_fp8_kv"  # the emulation's attention function, registered in transformers


@pytest.fixture(scope="module")
def scaled(demo_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo checkpoint with per-layer K/V scales, as FP8 checkpoints ship them."""
    from safetensors.torch import load_file, save_file

    out = tmp_path_factory.mktemp("fp8kv") / "demo-kv-scales"
    shutil.copytree(demo_dir, out)
    (weights,) = out.glob("*.safetensors")
    tensors = load_file(str(weights))
    for i in range(4):
        tensors[f"model.layers.{i}.self_attn.k_scale"] = torch.tensor(0.05 * (i + 1))
        tensors[f"model.layers.{i}.self_attn.v_scale"] = torch.tensor([0.02 * (i + 2)])
    save_file(tensors, str(weights), metadata={"format": "pt"})
    return out


def _emulation(path: Path, scales: dict[int, tuple[float, float]]) -> Any:
    """transformers' model of `path` whose attention reads K and V as an FP8 cache holds them."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    def fp8_kv_attention(module: Any, query: Any, key: Any, value: Any, *args: Any, **kw: Any):  # noqa: ANN202
        ks, vs = scales.get(module.layer_idx, (1.0, 1.0))
        key, value = kv_quant.round_trip(key, ks), kv_quant.round_trip(value, vs)
        return sdpa_attention_forward(module, query, key, value, *args, **kw)

    AttentionInterface.register(ATTN, fp8_kv_attention)
    model = load_hf(path)
    model.set_attn_implementation(ATTN)
    return model


def _prompts() -> list[list[int]]:
    rng = random.Random(8)
    prompts = [[rng.randrange(3, 3800) for _ in range(n)] for n in LENGTHS]
    return [*prompts, prompts[-1][:50] + [7, 8, 9]]  # shares 3 blocks with the one before


@pytest.mark.parametrize(
    "engine",
    [
        {},
        # Chunks of 16 tokens: a prompt's later chunks read its first ones from the cache.
        {"max_num_batched_tokens": 16, "cpu_kernels": False},
    ],
    ids=["default", "chunked"],
)
def test_greedy_tokens_are_the_emulations(demo_dir: Path, engine: dict) -> None:
    prompts = _prompts()
    llm = LLM(str(demo_dir), kv_cache_dtype="fp8", kv_cache_memory_bytes=8 << 20, **engine)
    try:
        outs = llm.generate(prompts, GREEDY, use_tqdm=False)
        again = llm.generate(prompts[-2:], GREEDY, use_tqdm=False)  # from the prefix cache
    finally:
        llm.engine.shutdown()
    hf = _emulation(demo_dir, {})
    assert_greedy_and_logprobs_match(hf, prompts, outs, MAX_TOKENS, LOGPROB_TOL)
    for a, b in zip(outs[-2:], again, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids


def test_the_checkpoints_kv_scales_are_used(scaled: Path) -> None:
    scales = {i: (0.05 * (i + 1), 0.02 * (i + 2)) for i in range(4)}
    prompts = _prompts()[:4]
    llm = LLM(str(scaled), kv_cache_dtype="fp8", kv_cache_memory_bytes=8 << 20)
    try:
        attn = [layer.self_attn.attn for layer in llm.engine.executor.worker.model.layers]
        got = [s for a in attn for s in (a.k_scale, a.v_scale)]
        assert got == pytest.approx([s for pair in scales.values() for s in pair])
        outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    finally:
        llm.engine.shutdown()
    hf = _emulation(scaled, scales)
    exact = sum(
        assert_greedy_match(hf, p, o.outputs[0].token_ids, hf_greedy(hf, p, MAX_TOKENS))
        for p, o in zip(prompts, outs, strict=True)
    )
    assert exact >= len(prompts) - 1


def test_the_cache_holds_four_times_float32s_tokens(demo_dir: Path) -> None:
    blocks = {}
    for dtype in ("auto", "fp8"):
        llm = LLM(str(demo_dir), kv_cache_dtype=dtype, kv_cache_memory_bytes=8 << 20)
        try:
            blocks[dtype] = llm.engine.block_manager.num_blocks
            cache = llm.engine.executor.worker.kv_caches[0][0]
            assert cache.dtype == (kv_quant.FP8 if dtype == "fp8" else torch.float32)
        finally:
            llm.engine.shutdown()
    assert blocks["fp8"] == 4 * blocks["auto"]


def test_a_bad_kv_cache_dtype_is_refused_by_name(demo_dir: Path) -> None:
    with pytest.raises(ValueError, match=r"kv_cache_dtype must be one of .*'int4'"):
        LLM(str(demo_dir), kv_cache_dtype="int4")


def test_the_host_tier_gives_back_fp8_blocks_unchanged(demo_dir: Path) -> None:
    """A prefix evicted from a 12-block FP8 cache comes back from the host tier (its bytes
    copied out and in through uint8 views): the tokens of the run that recomputed it."""
    from workers.config import EngineArgs
    from workers.kv_layout import kv_block_bytes

    prefix = list(range(10, 110))  # 6 full blocks
    prompts = [prefix + [200], *([300 + 7 * k + i for i in range(120)] for k in range(3))]
    prompts.append(prefix + [400, 401])
    per_block = kv_block_bytes(EngineArgs(str(demo_dir), kv_cache_dtype="fp8").create_config(), 1)
    runs = {}
    for gib in (1 / 64, 0):
        llm = LLM(
            str(demo_dir),
            kv_cache_dtype="fp8",
            kv_cache_memory_bytes=12 * per_block,
            kv_offload_gib=gib,
        )
        try:
            outs = [llm.generate([p], GREEDY, use_tqdm=False)[0] for p in prompts]
            runs[gib] = [o.outputs[0].token_ids for o in outs], llm.stats()
        finally:
            llm.engine.shutdown()
    assert runs[1 / 64][0] == runs[0][0]
    assert runs[1 / 64][1].kv_offload_hit_tokens == 96 and runs[0][1].kv_offload_hit_tokens == 0


def test_the_triton_backend_reads_and_writes_the_same_cache(scaled: Path) -> None:
    """The triton backend (Triton's interpreter on CPU) on an FP8 cache with the checkpoint's
    scales: the torch path's tokens, through its store (torch's rounding, then a byte copy)
    and its scaled reads."""
    prompts = _prompts()[1:4]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    tokens = {}
    for backend in ("torch", "triton"):
        llm = LLM(
            str(scaled),
            kv_cache_dtype="fp8",
            kv_cache_memory_bytes=8 << 20,
            attention_backend=backend,
            compile=False,
        )
        try:
            tokens[backend] = [
                o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)
            ]
        finally:
            llm.engine.shutdown()
    assert tokens["triton"] == tokens["torch"]

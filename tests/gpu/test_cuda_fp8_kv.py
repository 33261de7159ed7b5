"""The FP8 KV cache on CUDA (run by tests/gpu/check.sh): the torch backend (its cache indexed
through uint8 views, read through gathers) and the triton backend (its kernels convert each
tile as they load it), eager and with decode graphs, give the FP8-cache tokens of the CPU
engine in float32 (held to an exact emulation in transformers by
tests/workers/test_fp8_kv_parity.py); and in bfloat16 the FP8 cache holds twice the blocks."""

from __future__ import annotations

import random

import pytest
import torch

from workers import LLM, SamplingParams
from workers.demo import demo_model_dir

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
_rng = random.Random(8)
PROMPTS = [[_rng.randrange(3, 3800) for _ in range(n)] for n in (1, 7, 33, 90, 300)]


def _tokens(**kw) -> list[list[int]]:  # noqa: ANN003
    llm = LLM(str(demo_model_dir()), kv_cache_dtype="fp8", kv_cache_memory_bytes=64 << 20, **kw)
    try:
        return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    finally:
        llm.engine.shutdown()


@pytest.fixture(scope="module")
def cpu_tokens() -> list[list[int]]:
    return _tokens(device="cpu", dtype="float32")


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("compile", [False, True], ids=["eager", "graphs"])
def test_cuda_backends_give_the_cpu_engines_tokens(
    backend: str, compile: bool, cpu_tokens: list[list[int]]
) -> None:
    got = _tokens(device="cuda", dtype="float32", attention_backend=backend, compile=compile)
    same = sum(a == b for a, b in zip(got, cpu_tokens, strict=True))
    assert same >= len(PROMPTS) - 1, (got, cpu_tokens)  # a near-tie may flip one


def test_bf16_fp8_cache_holds_twice_the_blocks() -> None:
    blocks = {}
    for kv in ("auto", "fp8"):
        llm = LLM(
            str(demo_model_dir()),
            dtype="bfloat16",
            kv_cache_dtype=kv,
            kv_cache_memory_bytes=64 << 20,
        )
        try:
            blocks[kv] = llm.engine.block_manager.num_blocks
            llm.generate(PROMPTS[:2], GREEDY, use_tqdm=False)
        finally:
            llm.engine.shutdown()
    assert blocks["fp8"] == 2 * blocks["auto"]

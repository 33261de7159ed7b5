"""Gemma's RMSNorm (x * (1 + w), float32 math, the weight folded at load time) against
transformers' Gemma3RMSNorm, bit for bit in every dtype; on the CPU kernel (x * w with the
folded weight) to float rounding."""

from __future__ import annotations

import pytest
import torch
from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm

from workers.device.layers.cpu_kernels import kernel, register
from workers.device.layers.norm import GemmaRMSNorm, RMSNorm


def _pair(dim: int, dtype: torch.dtype, w: torch.Tensor) -> tuple[GemmaRMSNorm, Gemma3RMSNorm]:
    """Ours loaded from checkpoint weight `w` as the loader loads it, and transformers'
    holding `w` in the model dtype (from_pretrained casts it there)."""
    ours = GemmaRMSNorm(dim, 1e-6, dtype)
    ours.weight.data.copy_(ours.from_checkpoint(w))
    theirs = Gemma3RMSNorm(dim, eps=1e-6).to(dtype)
    with torch.no_grad():
        theirs.weight.copy_(w.to(dtype))
    return ours, theirs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("ckpt_dtype", [torch.float32, torch.bfloat16])
def test_equals_transformers_bit_for_bit(dtype: torch.dtype, ckpt_dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(96, generator=gen).to(ckpt_dtype)  # a float32 checkpoint served in bf16 too
    ours, theirs = _pair(96, dtype, w)
    x = (torch.randn(5, 3, 96, generator=gen) * 4).to(dtype)
    assert ours.weight.dtype == torch.float32
    assert torch.equal(ours(x), theirs(x))


def test_folding_is_what_the_llama_norm_multiplies_in_float32() -> None:
    # In float32 Gemma's (h * (1 + w)) is RMSNorm's w' * h with w' = 1 + w: the kernel's math.
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(64, generator=gen)
    ours, _ = _pair(64, torch.float32, w)
    llama = RMSNorm(64, 1e-6, torch.float32)
    llama.weight.data.copy_(1.0 + w)
    x = torch.randn(7, 64, generator=gen)
    assert torch.equal(ours(x), llama(x))


@pytest.mark.parametrize("shape", [(1, 256), (300, 256), (6, 4, 48)])
def test_kernel_path_matches_transformers(shape: tuple[int, ...]) -> None:
    lib = kernel()
    if lib is None:
        pytest.skip("no C compiler: the engine uses the torch path")
    gen = torch.Generator().manual_seed(2)
    w = torch.randn(shape[-1], generator=gen)
    ours, theirs = _pair(shape[-1], torch.float32, w)
    ours.cpu_kernels = register(lib)
    x = torch.randn(*shape, generator=gen) * 4
    with torch.no_grad():
        expected = theirs(x)
    torch.testing.assert_close(ours(x), expected, atol=1e-5, rtol=1e-5)

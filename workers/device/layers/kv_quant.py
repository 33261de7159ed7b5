"""The FP8 KV cache (CacheConfig.kv_cache_dtype "fp8"): float8 e4m3 elements, each K (or V)
value stored as `value / scale`, read back as `element * scale`, with one scale per layer for
K and one for V (the checkpoint's `self_attn.k_scale` / `v_scale`, else 1.0).

Values are written after RoPE, as the cache holds them either way. Every attention path reads
the cache's values, a prefill chunk's own fresh K/V included (rounded as the cache holds them),
so a token's attention does not depend on how its prompt was chunked or cached. e4m3 has no
infinity: what falls outside +-448 after scaling is clamped there, not turned into NaN (a CPU
cast saturates and a CUDA one need not). The cache's storage is indexed through a uint8 view:
torch's index_copy_ has no float8 kernel on CPU.
"""

from __future__ import annotations

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448


def is_fp8(cache: torch.Tensor) -> bool:
    return cache.dtype == FP8


def quantize(x: torch.Tensor, scale: float) -> torch.Tensor:
    """x (any float dtype) as the cache stores it."""
    return (x.float() / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8)


def dequantize(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """Cache elements as values of `dtype` (the product in float32, then rounded once)."""
    return (x.float() * scale).to(dtype)


def round_trip(x: torch.Tensor, scale: float) -> torch.Tensor:
    """x as it reads back from the cache."""
    return dequantize(quantize(x, scale), scale, x.dtype)


def store(flat_cache: torch.Tensor, slots: torch.Tensor, x: torch.Tensor, scale: float) -> None:
    """Writes x [T, ...] into rows `slots` of the flattened cache [num_slots, ...]."""
    if is_fp8(flat_cache):
        flat_cache.view(torch.uint8).index_copy_(0, slots, quantize(x, scale).view(torch.uint8))
    else:
        flat_cache.index_copy_(0, slots, x)


def read(cache_part: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """Gathered cache elements as values of the model's `dtype`."""
    return dequantize(cache_part, scale, dtype) if is_fp8(cache_part) else cache_part

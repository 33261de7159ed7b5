"""The KV cache's settings (EngineConfig.cache): its block size, prefix caching, size, the
KV tiers it feeds, and its element type."""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_BLOCK_SIZE = 16  # tokens per KV-cache block
# The KV cache's element type: "auto" is the model's dtype; "fp8" stores float8 e4m3 (one
# byte) with a per-layer scale for K and one for V (the checkpoint's, else 1.0), written after
# RoPE and read back by every attention path (workers/device/layers/kv_quant.py).
KV_CACHE_DTYPES = ("auto", "fp8")


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = DEFAULT_BLOCK_SIZE
    enable_prefix_caching: bool = True
    kv_cache_memory_bytes: int | None = None  # None: a fraction of free memory (CUDA) / 1 GiB (CPU)
    gpu_memory_utilization: float = 0.85
    kv_events: bool = False  # record prefix-cache KV events for a KV-aware router
    kv_offload_gib: float = 0.0  # the host KV tier (workers/core/host_tier.py); 0: off
    kv_share: bool = False  # export full blocks for the cluster tier (workers/core/kv_share.py)
    kv_cache_dtype: str = "auto"  # KV_CACHE_DTYPES

    def __post_init__(self) -> None:
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}"
            )
        g = self.kv_offload_gib
        if isinstance(g, bool) or not isinstance(g, (int, float)) or not 0 <= g < float("inf"):
            raise ValueError(f"kv_offload_gib must be a number >= 0, got {g!r}")
        if self.kv_share and not (g > 0 and self.kv_events and self.enable_prefix_caching):
            raise ValueError("kv_share needs kv_offload_gib > 0, kv_events and prefix caching")

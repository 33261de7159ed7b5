"""Which GEMM serves a linear layer's step: the bfloat16-weight kernel, the skinny one or
torch's linear (the BLAS). The `kvray::linear` op (ops.py) and the direct layer calls
(workers/device/models/cpu_layers.py) both route by `kernel_route`."""

from __future__ import annotations

import torch

from workers.device.layers.cpu_kernels.packing import amx_packed

# Rows (tokens) for which the skinny kernel beat torch's linear, measured per token count
# with the demo model's and the 100M checkpoint's weight shapes (docs/benchmarks.md):
# 1.0-1.2x and 1.2-2.0x from 4 to 24 rows; even (0.94-1.05x) at 1-2 rows; behind the BLAS
# from 32 rows (demo) or 48 (100M) up.
SKINNY_ROWS = range(4, 25)
# Rows up to which the bfloat16-weight kernel is used: against torch's linear on the float32
# weights it measured 2-4x from 1 to 16 rows, ~2x at 32, 1.2-1.5x at 64-192 and 1.06-1.18x at
# 256 with the 100M and 0.6B checkpoints' shapes; 0.98x at 384 (docs/benchmarks.md, "Linear layers
# per step size"; `kvray bench kernels`).
BF16_MAX_ROWS = 256


def kernel_route(
    rows: int, weight: torch.Tensor | None, packed_weight: torch.Tensor | None
) -> str | None:
    """Which CPU GEMM kernel serves a linear layer's step of `rows` rows: "bf16" (the
    bfloat16-weight one), "skinny", or None (torch's linear). `weight` None or a meta tensor:
    the float32 copy was freed and the packed one serves every step. On AMX the packed copy
    beat torch's linear at every step size (1.7-3.7x, docs/benchmarks.md)."""
    freed = weight is None or weight.is_meta
    if packed_weight is not None and (rows <= BF16_MAX_ROWS or freed or amx_packed(packed_weight)):
        return "bf16"
    if rows in SKINNY_ROWS and not freed:
        return "skinny"
    return None

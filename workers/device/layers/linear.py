"""Megatron-style parallel linear layers.

Column-parallel splits the output features (each rank owns some heads / some of the MLP
width, no communication); row-parallel splits the input features and ends with exactly one
all-reduce. Biases of row-parallel layers are added once, after the reduction.
Weights are filled by `workers.device.loader`, which hands each layer only its own slice.

On CPU in float32, `linear` sends steps of a few rows (a decode step of a few sequences) to
C kernels where the BLAS runs far below the memory bandwidth
(`workers.device.layers.cpu_kernels.use_cpu_kernels` turns them on): weights that are exactly
bfloat16 (a bfloat16 checkpoint) to csrc/bf16_linear.c, which streams half the bytes (and
serves every step once the float32 copy is freed; AVX2 or AVX-512 builds), or on CPUs with
AMX to csrc/amx_linear.c (`pack_bf16_weight` chose the layout, `bf16_linear` follows it);
other float32 weights to the skinny GEMM, csrc/skinny_gemm.c (AVX-512 builds).
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import nn

from workers.device.distributed import TPGroup
from workers.device.layers.cpu_kernels import amx_packed, bf16_linear, skinny_linear

# Rows (tokens) for which the skinny kernel beat torch's linear, measured per token count
# with the demo model's and the 100M checkpoint's weight shapes (README, "CPU kernels"):
# 1.0-1.2x and 1.2-2.0x from 4 to 24 rows; even (0.94-1.05x) at 1-2 rows; behind the BLAS
# from 32 rows (demo) or 48 (100M) up.
SKINNY_ROWS = range(4, 25)
# Rows up to which the bfloat16-weight kernel is used: against torch's linear on the float32
# weights it measured 2-4x from 1 to 16 rows, ~2x at 32, 1.2-1.5x at 64-192 and 1.06-1.18x at
# 256 with the 100M and 0.6B checkpoints' shapes; 0.98x at 384 (README, "bfloat16 weights
# on CPU"; `kvray bench kernels`).
BF16_MAX_ROWS = 256


def kernel_route(
    rows: int, weight: torch.Tensor, packed_weight: torch.Tensor | None
) -> Literal["bf16", "skinny"] | None:
    """Which CPU GEMM kernel serves a linear layer's step of `rows` rows: the bfloat16-weight
    one, the skinny one, or None (torch's linear). `linear` and the direct layer calls
    (workers/device/models/cpu_layers.py) both route by it."""
    # A meta `weight`: the float32 copy was freed and the packed one serves every step. On
    # AMX the packed copy beat torch's linear at every step size (1.7-3.7x, README).
    if packed_weight is not None and (
        rows <= BF16_MAX_ROWS or weight.is_meta or amx_packed(packed_weight)
    ):
        return "bf16"
    if rows in SKINNY_ROWS:
        return "skinny"
    return None


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    cpu_kernels: object,
    packed_weight: torch.Tensor | None = None,
) -> torch.Tensor:
    """`nn.functional.linear`, through a CPU kernel where one is faster; `packed_weight` is
    `weight` packed in bfloat16 (`cpu_kernels.pack_bf16_weight`) when it is exactly that."""
    if (
        cpu_kernels is not None
        # First: the compiled pieces keep torch's op, and their token count is symbolic.
        and not torch.compiler.is_compiling()
        and x.dim() == 2
    ):
        route = kernel_route(x.shape[0], weight, packed_weight)
        if route == "bf16":
            return bf16_linear(cpu_kernels, x, packed_weight, weight.shape[0], bias)
        if route == "skinny":
            return skinny_linear(cpu_kernels, x, weight, bias)
    return nn.functional.linear(x, weight, bias)


class ColumnParallelLinear(nn.Module):
    """y = x @ W[rows of this rank].T; `output_sizes` lists fused sub-matrices (e.g. q, k, v)."""

    def __init__(
        self, in_features: int, output_sizes: list[int], bias: bool, tp: TPGroup, dtype: torch.dtype
    ) -> None:
        super().__init__()
        self.tp = tp
        self.output_sizes = output_sizes  # per-rank sizes of each fused part
        out = sum(output_sizes)
        self.weight = nn.Parameter(torch.empty(out, in_features, dtype=dtype), requires_grad=False)
        self.bias = (
            nn.Parameter(torch.zeros(out, dtype=dtype), requires_grad=False) if bias else None
        )
        self.cpu_kernels: object = None  # set by workers.device.layers.cpu_kernels.use_cpu_kernels
        self.packed_weight: torch.Tensor | None = None  # likewise, for bfloat16 weights

    def part_offset(self, index: int) -> int:
        return sum(self.output_sizes[:index])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.cpu_kernels, self.packed_weight)


class RowParallelLinear(nn.Module):
    """y = all_reduce(x[:, cols of this rank] @ W[:, cols].T) + b."""

    def __init__(
        self,
        in_features_per_rank: int,
        out_features: int,
        bias: bool,
        tp: TPGroup,
        dtype: torch.dtype,
    ) -> None:
        super().__init__()
        self.tp = tp
        self.weight = nn.Parameter(
            torch.empty(out_features, in_features_per_rank, dtype=dtype), requires_grad=False
        )
        self.bias = (
            nn.Parameter(torch.zeros(out_features, dtype=dtype), requires_grad=False)
            if bias
            else None
        )
        self.cpu_kernels: object = None  # set by workers.device.layers.cpu_kernels.use_cpu_kernels
        self.packed_weight: torch.Tensor | None = None  # likewise, for bfloat16 weights

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.tp.all_reduce(linear(x, self.weight, None, self.cpu_kernels, self.packed_weight))
        if self.bias is not None:
            y = y + self.bias
        return y

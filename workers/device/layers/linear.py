"""Megatron-style parallel linear layers.

Column-parallel splits the output features (each rank owns some heads / some of the MLP
width, no communication); row-parallel splits the input features and ends with exactly one
all-reduce. Biases of row-parallel layers are added once, after the reduction.
Weights are filled by `workers.device.loader`, which hands each layer only its own slice.

On CPU in float32, `linear` sends steps of a few rows (a decode step of a few sequences) to
C kernels where the BLAS runs far below the memory bandwidth
(`workers.device.layers.cpu_kernels.use_cpu_kernels` turns them on, the `kvray::linear`
op routes each step: workers/device/layers/cpu_kernels/routing.py): weights that are exactly
bfloat16 (a bfloat16 checkpoint) to csrc/bf16_linear.c, which streams half the bytes (and
serves every step once the float32 copy is freed; AVX2 or AVX-512 builds), or on CPUs with
AMX to csrc/amx_linear.c (`pack_bf16_weight` chose the layout, `bf16_linear` follows it);
other float32 weights to the skinny GEMM, csrc/skinny_gemm.c (AVX-512 builds).
"""

from __future__ import annotations

import torch
from torch import nn

from workers.device.distributed import TPGroup
from workers.device.layers.cpu_kernels import kernel_linear
from workers.lora.layers import LoraSlots


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    cpu_kernels: int | None,
    packed_weight: torch.Tensor | None = None,
) -> torch.Tensor:
    """`nn.functional.linear`, through a CPU kernel where one is faster (the `kvray::linear`
    op routes each step by its rows, eager or compiled: `kernel_route`); `cpu_kernels` is the
    kernel library's handle, `packed_weight` `weight` packed in bfloat16
    (`cpu_kernels.pack_bf16_weight`) when it is exactly that."""
    if cpu_kernels is not None and x.dim() == 2:
        return kernel_linear(cpu_kernels, x, weight, bias, packed_weight)
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
        self.cpu_kernels: int | None = None  # set by cpu_kernels.use_cpu_kernels
        self.packed_weight: torch.Tensor | None = None  # likewise, for bfloat16 weights
        self.lora: LoraSlots | None = None  # set by workers.lora.device.attach_lora

    def part_offset(self, index: int) -> int:
        return sum(self.output_sizes[:index])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = linear(x, self.weight, self.bias, self.cpu_kernels, self.packed_weight)
        if self.lora is not None and self.lora.batch.active:
            y = self.lora.add_to(x, y)
        return y


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
        self.cpu_kernels: int | None = None  # set by cpu_kernels.use_cpu_kernels
        self.packed_weight: torch.Tensor | None = None  # likewise, for bfloat16 weights
        self.lora: LoraSlots | None = None  # set by workers.lora.device.attach_lora

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = linear(x, self.weight, None, self.cpu_kernels, self.packed_weight)
        if self.lora is not None and self.lora.batch.active:
            y = self.lora.add_to(x, y)  # before the all-reduce: it sums the partial deltas too
        y = self.tp.all_reduce(y)
        if self.bias is not None:
            y = y + self.bias
        return y

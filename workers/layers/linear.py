"""Megatron-style parallel linear layers.

Column-parallel splits the output features (each rank owns some heads / some of the MLP
width, no communication); row-parallel splits the input features and ends with exactly one
all-reduce. Biases of row-parallel layers are added once, after the reduction.
Weights are filled by `workers.loader`, which hands each layer only its own slice.
"""

from __future__ import annotations

import torch
from torch import nn

from workers.distributed import TPGroup


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

    def part_offset(self, index: int) -> int:
        return sum(self.output_sizes[:index])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x, self.weight, self.bias)


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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.tp.all_reduce(nn.functional.linear(x, self.weight))
        if self.bias is not None:
            y = y + self.bias
        return y

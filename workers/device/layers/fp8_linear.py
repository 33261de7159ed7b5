"""Parallel linear layers over FP8 block-scaled weights (workers/quantization.py).

The weight stays float8_e4m3fn in memory (a byte per element: half of bfloat16, a quarter of
float32) with one float32 scale per 128x128 block (`weight_scale_inv`, the checkpoint's name:
the weight is fp8 * scale). Each forward dequantizes it blockwise into the input's dtype and
multiplies there: w = fp8.to(dtype) * scale.to(dtype) per block, which in float32 is the very
product transformers' loader computes, so float32 greedy tokens match its. A simple, correct
path; a fused FP8 GEMM kernel is later work.

Fused projections (q/k/v, gate/up) keep each part's scale grid: the parts' grids are stacked,
and `scale_rows` maps every output row to its block's row, so a part need not end on a block
boundary. Tensor parallelism splits the weight and its grid along the base layer's split; a
shard that would cut a block is refused (QuantizationConfig.check_tensor_parallel, and the
loader for each tensor).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from workers.device.distributed import TPGroup
from workers.device.layers.int4_linear import Int4ColumnParallelLinear, Int4RowParallelLinear
from workers.device.layers.int8_linear import Int8ColumnParallelLinear, Int8RowParallelLinear
from workers.device.layers.linear import ColumnParallelLinear, RowParallelLinear
from workers.device.layers.quantized_parallel import (
    QuantizedColumnParallel,
    QuantizedRowParallel,
    with_lora,
)
from workers.lora.layers import LoraSlots
from workers.quantization import FP8_BLOCK, QuantizationConfig

FP8_DTYPE = torch.float8_e4m3fn


def blocks(n: int, block: int | None = FP8_BLOCK) -> int:
    """Scales covering `n` rows (or columns), `block` per scale (None: all of them)."""
    return 1 if block is None else -(-n // block)


def scale_rows(sizes: list[int], row_block: int | None = FP8_BLOCK) -> torch.Tensor:
    """For each row of the fused parts of `sizes` rows, the row of the stacked scale grids
    that scales it (each part's grid starts where the previous part's ends); `row_block`:
    weight rows per scale (1: per channel; None: one scale per part, per tensor)."""
    rows, first = [], 0
    for size in sizes:
        within = torch.zeros(size, dtype=torch.long) if row_block is None else torch.arange(size)
        rows.append(first + (within if row_block is None else within // row_block))
        first += blocks(size, row_block)
    return torch.cat(rows)


def dequantize(
    weight: torch.Tensor, scale: torch.Tensor, rows: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """`weight` [..., N, K] (fp8) times its block scales `scale` [..., rows of the grids,
    blocks(K)], in `dtype`; `rows` [N]: each weight row's row of the grid."""
    s = scale.index_select(-2, rows).to(dtype)  # [..., N, blocks(K)]
    k, nk = weight.shape[-1], s.shape[-1]
    w = weight.to(dtype)
    if nk == 1:  # one scale across the columns (per channel, per tensor, or K <= a block)
        return w * s
    if k == nk * FP8_BLOCK:  # the scales broadcast over each block's columns: no [N, K] copy
        return (w.unflatten(-1, (nk, FP8_BLOCK)) * s.unsqueeze(-1)).flatten(-2)
    return w * s.repeat_interleave(FP8_BLOCK, dim=-1)[..., :k]


class _Fp8Linear(nn.Module):
    """An FP8 weight [sum(output_sizes), in_features], its stacked scale grids, a bias."""

    def __init__(
        self,
        in_features: int,
        output_sizes: list[int],
        bias: bool,
        tp: TPGroup,
        dtype: torch.dtype,
        quant: QuantizationConfig | None = None,
    ) -> None:
        super().__init__()
        self.tp = tp
        self.output_sizes = output_sizes  # per-rank sizes of each fused part
        # Weight rows and columns per scale (QuantizationConfig.row_block / col_block).
        self.row_block = FP8_BLOCK if quant is None else quant.row_block
        self.col_block = FP8_BLOCK if quant is None else quant.col_block
        out = sum(output_sizes)
        self.weight = nn.Parameter(torch.empty(out, in_features, dtype=FP8_DTYPE), False)
        grid = (
            sum(blocks(s, self.row_block) for s in output_sizes),
            blocks(in_features, self.col_block),
        )
        self.weight_scale_inv = nn.Parameter(torch.empty(grid, dtype=torch.float32), False)
        rows = scale_rows(output_sizes, self.row_block)
        self.register_buffer("scale_rows", rows, persistent=False)
        self.bias = nn.Parameter(torch.zeros(out, dtype=dtype), False) if bias else None
        self.lora: LoraSlots | None = None  # set by workers.lora.device.attach_lora

    def part_offset(self, index: int) -> int:
        return sum(self.output_sizes[:index])

    def scale_offset(self, index: int) -> int:
        """The first row of part `index`'s scale grid."""
        return sum(blocks(s, self.row_block) for s in self.output_sizes[:index])

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        w = dequantize(self.weight, self.weight_scale_inv, self.scale_rows, x.dtype)
        return with_lora(self, x, F.linear(x, w, bias))


class Fp8ColumnParallelLinear(QuantizedColumnParallel, _Fp8Linear):
    """ColumnParallelLinear over an FP8 weight: this rank's rows and their scale rows."""


class Fp8RowParallelLinear(QuantizedRowParallel, _Fp8Linear):
    """RowParallelLinear over an FP8 weight: this rank's columns and their scale columns,
    one all-reduce, the bias after it."""


def column_parallel(
    quant: QuantizationConfig | None,
    in_features: int,
    output_sizes: list[int],
    bias: bool,
    tp: TPGroup,
    dtype: torch.dtype,
) -> nn.Module:
    """A column-parallel projection: FP8, int8 or int4 (int8_linear.py, int4_linear.py) when
    the checkpoint is, else full precision."""
    if quant is None:
        return ColumnParallelLinear(in_features, output_sizes, bias, tp, dtype)
    if quant.weights == "int8":
        return Int8ColumnParallelLinear(in_features, output_sizes, bias, tp, dtype, quant)
    if quant.weights == "int4":
        return Int4ColumnParallelLinear(in_features, output_sizes, bias, tp, dtype, quant)
    return Fp8ColumnParallelLinear(in_features, output_sizes, bias, tp, dtype, quant)


def row_parallel(
    quant: QuantizationConfig | None,
    in_features_per_rank: int,
    out_features: int,
    bias: bool,
    tp: TPGroup,
    dtype: torch.dtype,
) -> nn.Module:
    """A row-parallel projection: FP8, int8 or int4 (int8_linear.py, int4_linear.py) when
    the checkpoint is, else full precision."""
    if quant is None:
        return RowParallelLinear(in_features_per_rank, out_features, bias, tp, dtype)
    if quant.weights == "int8":
        return Int8RowParallelLinear(in_features_per_rank, out_features, bias, tp, dtype, quant)
    if quant.weights == "int4":
        return Int4RowParallelLinear(in_features_per_rank, out_features, bias, tp, dtype, quant)
    return Fp8RowParallelLinear(in_features_per_rank, out_features, bias, tp, dtype, quant)

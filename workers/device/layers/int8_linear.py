"""Parallel linear layers over int8 weight-only (W8A16) weights: compressed-tensors'
int-quantized format (workers/compressed_tensors.py).

The weight stays int8 in memory (a byte per element, as FP8) with a float32 `weight_scale`
[out, 1] per output channel or [out, in / group_size] per group of input columns: the weight
is int8 * scale. Two forwards:

- reference: dequantize into the input's dtype (int8.to(dtype) * scale.to(dtype), group by
  group) and multiply there. In float32 that is the very product transformers' loader computes
  (its `dequantize=True`), so float32 greedy tokens match its.
- fast, on CPU with per-channel scales, a bfloat16 input and at most FAST_MAX_ROWS rows (decode
  steps): `torch._weight_int8pack_mm(x, int8, scale)`, which reads the int8 weight directly and
  scales each output after the dot product (no [out, in] copy per call). Measured on a 2-vCPU
  AMD EPYC, torch 2.13 CPU, 1 thread: about 2x a bfloat16 matmul at 1 row, even at ~4, slower
  than one beyond ~8, and slower than the reference beyond ~16-32 rows (it runs row by row);
  in float32 and float16 the op is 10-20x slower than a matmul (not vectorized there), so
  those dtypes keep the reference. Equal to the reference up to rounding (the scale applied
  after the sum instead of to each weight); tests/workers/test_compressed_tensors_parity.py
  holds it to the reference path's greedy tokens and its logprobs within a tolerance.
  `fast_path` (on by default, set from EngineArgs.cpu_kernels by workers/device/forward.py)
  turns it off.

Fused projections (q/k/v, gate/up) stack the parts' rows and their scale rows (a scale row
per weight row). Tensor parallelism splits the weight and its scales along the base layer's
split: a column-parallel rank takes its rows of both, a row-parallel rank its columns and
its groups' scale columns (all of the one column per channel); a shard that would cut a group
is refused (QuantizationConfig.check_tensor_parallel, and the loader for each tensor).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from workers.device.distributed import TPGroup
from workers.device.layers.quantized_parallel import (
    QuantizedColumnParallel,
    QuantizedRowParallel,
    with_lora,
)
from workers.lora.layers import LoraSlots
from workers.quantization import QuantizationConfig

INT8_DTYPE = torch.int8
# The input dtypes for which torch's CPU int8 weight GEMM beats the reference (it also takes
# float32 and float16, 10-20x slower than a matmul there), and the most rows it gets: beyond,
# dequantizing once and one matmul is as fast or faster.
FAST_DTYPES = (torch.bfloat16,)
FAST_MAX_ROWS = 16


def dequantize_int8(weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`weight` [N, K] (int8) times its scales `scale` [N, groups], in `dtype`: one scale per
    row (groups == 1) or per K / groups columns of a row."""
    s = scale.to(dtype)
    w = weight.to(dtype)
    groups = s.shape[-1]
    if groups == 1:
        return w * s
    return (w.unflatten(-1, (groups, w.shape[-1] // groups)) * s.unsqueeze(-1)).flatten(-2)


class _Int8Linear(nn.Module):
    """An int8 weight [sum(output_sizes), in_features], its scales, a bias."""

    def __init__(
        self,
        in_features: int,
        output_sizes: list[int],
        bias: bool,
        tp: TPGroup,
        dtype: torch.dtype,
        quant: QuantizationConfig,
    ) -> None:
        super().__init__()
        self.tp = tp
        self.output_sizes = output_sizes  # per-rank sizes of each fused part
        # Weight rows and columns per scale (the loader's view): a row each, and a group of
        # columns (None: all of them, per channel).
        self.row_block, self.col_block = 1, quant.col_block
        out = sum(output_sizes)
        groups = 1 if self.col_block is None else -(-in_features // self.col_block)
        self.weight = nn.Parameter(torch.empty(out, in_features, dtype=INT8_DTYPE), False)
        self.weight_scale = nn.Parameter(torch.empty(out, groups, dtype=torch.float32), False)
        self.bias = nn.Parameter(torch.zeros(out, dtype=dtype), False) if bias else None
        self.lora: LoraSlots | None = None  # set by workers.lora.device.attach_lora
        self.fast_path = True  # EngineArgs.cpu_kernels (workers/device/forward.py)

    def part_offset(self, index: int) -> int:
        return sum(self.output_sizes[:index])

    def scale_offset(self, index: int) -> int:
        """The first scale row of part `index` (a scale row per weight row)."""
        return self.part_offset(index)

    def uses_fast_path(self, dtype: torch.dtype, rows: int) -> bool:
        """Whether an input of `rows` rows of `dtype` runs `torch._weight_int8pack_mm`: the
        weight on the CPU (the op's fast kernel), scales per channel, FAST_DTYPES, at most
        FAST_MAX_ROWS rows."""
        return (
            self.fast_path
            and self.weight.device.type == "cpu"
            and self.weight_scale.shape[-1] == 1
            and dtype in FAST_DTYPES
            and rows <= FAST_MAX_ROWS
        )

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.uses_fast_path(x.dtype, x.numel() // x.shape[-1]):
            scale = self.weight_scale.view(-1).to(x.dtype)  # the op wants them in x's dtype
            flat = x.reshape(-1, x.shape[-1])
            y = torch._weight_int8pack_mm(flat, self.weight, scale).view(*x.shape[:-1], -1)
            if bias is not None:
                y = y + bias
        else:
            y = F.linear(x, dequantize_int8(self.weight, self.weight_scale, x.dtype), bias)
        return with_lora(self, x, y)


class Int8ColumnParallelLinear(QuantizedColumnParallel, _Int8Linear):
    """ColumnParallelLinear over an int8 weight: this rank's rows and their scale rows."""


class Int8RowParallelLinear(QuantizedRowParallel, _Int8Linear):
    """RowParallelLinear over an int8 weight: this rank's columns and their groups' scales,
    one all-reduce, the bias after it."""


def set_fast_path(model: nn.Module, on: bool) -> int:
    """Turns the int8 and int4 layers' fast paths on or off (EngineArgs.cpu_kernels; int4's
    packs its kernel's copy here, after loading: int4_linear.py); returns how many layers
    there are."""
    layers = [m for m in model.modules() if hasattr(m, "uses_fast_path")]
    for m in layers:
        m.fast_path = on
    return len(layers)

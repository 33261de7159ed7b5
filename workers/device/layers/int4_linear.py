"""Parallel linear layers over int4 weight-only (W4A16) weights: compressed-tensors'
pack-quantized format (workers/compressed_tensors.py), and GPTQ and AWQ checkpoints converted
into the same form at load (workers/gptq_awq.py).

In memory, whatever the checkpoint: `weight_packed` int32 [out, in / 8], eight 4-bit values
`q` in 0..15 per word along the input, lowest bits first (compressed-tensors' own layout: half
a byte per weight, a quarter of bfloat16); `weight_scale` float32 [out, groups]; `weight_zero`
uint8 [out, groups], the `q` that means 0 (8 for symmetric weights); for GPTQ's activation
order, `g_idx` int32 [in], each input column's group. The weight is (q - zero) * scale; with
`quant.offset` (GGUF's Q4_K, workers/gguf/int4.py) also `weight_offset` float32 [out, groups]
and zeros 0: (q - zero) * scale + offset, the float offset -dmin * min that no uint8 zero point
holds exactly.

Two forwards:
- reference, any device: unpack, dequantize into the input's dtype ((q - zero) as an integer,
  then times the scale) and multiply there. In float32 that is the very product transformers
  computes when it loads the checkpoint through the compressed-tensors package
  (`(x_q - zero_point) * scale`), so float32 greedy tokens match its.
- fast, on CPU with a bfloat16 input of at most FAST_MAX_ROWS rows (decode steps):
  `torch._weight_int4pack_mm_for_cpu`, torch's 4-bit GEMM, over a copy of the weight in its
  own packed layout (`_convert_weight_to_int4pack_for_cpu`, made once when the fast path is
  turned on) with scales, zeros and offsets folded into its (scale, scale * (8 - zero) +
  offset) pairs: it computes (q - 8) * scale + zero, its "zero" a float. Measured
  on a 2-vCPU AMD EPYC, torch 2.13 CPU, 1 thread, a 4096x768 projection: 157 us at 1 row
  against 438 us for a bfloat16 matmul (2.8x) and ~4 ms to dequantize-then-multiply; it runs
  row by row, so it loses to a bfloat16 matmul from ~16 rows and to the reference from ~48.
  In float32 it is 10-50x slower than a matmul: float32 keeps the reference. The copy costs
  another half byte per weight (a byte in all, still half of bfloat16). Needs: out a multiple
  of 16, groups of 32, 64, 128 or 256 columns (per-channel scales are repeated over the
  largest of those dividing the input), no activation order. `fast_path` (set by
  workers/device/forward.py from EngineArgs.cpu_kernels, after loading) turns it on or off.

Fused projections (q/k/v, gate/up) stack the parts' rows, scale rows and zero rows. Tensor
parallelism splits all of them along the base layer's split (workers/device/int4_targets.py);
a shard that would cut a group or a packed word is refused.
"""

from __future__ import annotations

import sys

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

PACK = 8  # 4-bit values per int32 word
SYMMETRIC_ZERO = 8  # the stored value of 0 in symmetric weights (compressed-tensors' + 8)
FAST_DTYPES = (torch.bfloat16,)
FAST_MAX_ROWS = 32  # measured crossover with dequantize-then-matmul: ~48 rows (see above)
_KERNEL_GROUPS = (256, 128, 64, 32)  # group sizes torch's CPU 4-bit GEMM takes
_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)


def unpack_int4(packed: torch.Tensor, columns: int) -> torch.Tensor:
    """`packed` int32 [N, ceil(columns / 8)] -> the values 0..15, uint8 [N, columns]."""
    if sys.byteorder == "little":  # a word's bytes hold values (0, 1), (2, 3), ...: split them
        b = packed.contiguous().view(torch.uint8)
        q = torch.stack((b & 0xF, b >> 4), dim=-1)
    else:
        shifts = _SHIFTS.to(packed.device)
        q = ((packed.unsqueeze(-1) >> shifts) & 0xF).to(torch.uint8)  # the mask drops the sign
    return q.flatten(-2)[..., :columns]


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """The inverse of `unpack_int4`: values 0..15 [N, K] -> int32 [N, ceil(K / 8)]."""
    n, k = q.shape
    padded = torch.zeros(n, -(-k // PACK) * PACK, dtype=torch.int64, device=q.device)
    padded[:, :k] = q.to(torch.int64)
    words = (padded.view(n, -1, PACK) << _SHIFTS.to(q.device, torch.int64)).sum(-1)
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)


def dequantize_int4(
    packed: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor,
    columns: int,
    dtype: torch.dtype,
    g_idx: torch.Tensor | None = None,
    offset: torch.Tensor | None = None,
) -> torch.Tensor:
    """(q - zero) * scale (+ offset) in `dtype`, [N, columns]: groups of columns / groups
    contiguous columns each (one group: per channel), or column k in group `g_idx[k]`."""
    # Small integers are exact in every float dtype: (q - zero) is, and the product with the
    # scale rounds once, as transformers' (x_q - zero_point) * scale does.
    q = unpack_int4(packed, columns).to(dtype)
    if g_idx is not None:
        idx = g_idx.long()
        w = (q - zero.index_select(-1, idx).to(dtype)) * scale.index_select(-1, idx).to(dtype)
        return w if offset is None else w + offset.index_select(-1, idx).to(dtype)
    groups = scale.shape[-1]
    q = q.unflatten(-1, (groups, columns // groups))
    w = (q - zero.to(dtype).unsqueeze(-1)) * scale.to(dtype).unsqueeze(-1)
    if offset is not None:  # GGUF Q4_K: d*sc*q - dmin*m, a product then a sum as ggml rounds
        w = w + offset.to(dtype).unsqueeze(-1)
    return w.flatten(-2)


class _Int4Linear(nn.Module):
    """A packed int4 weight [sum(output_sizes), in_features], its scales and zeros, a bias."""

    splits_input = False  # row-parallel: `in_features` is this rank's part

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
        self.in_features, self.dtype, self.quant = in_features, dtype, quant
        self.row_block, self.col_block = 1, quant.col_block  # a scale per row and group
        out = sum(output_sizes)
        # Under activation order a row-parallel rank's columns may be in any group: it holds
        # the scales and zeros of every group of the whole input.
        grouped = in_features * tp.size if quant.act_order and self.splits_input else in_features
        groups = 1 if self.col_block is None else -(-grouped // self.col_block)
        words = -(-in_features // PACK)
        self.weight_packed = nn.Parameter(torch.empty(out, words, dtype=torch.int32), False)
        self.weight_scale = nn.Parameter(torch.empty(out, groups, dtype=torch.float32), False)
        # With float offsets the zeros are 0: the offset carries the whole shift.
        zero = torch.full((out, groups), 0 if quant.offset else SYMMETRIC_ZERO, dtype=torch.uint8)
        self.weight_zero = nn.Parameter(zero, False)
        self.weight_offset = (
            nn.Parameter(torch.zeros(out, groups, dtype=torch.float32), False)
            if quant.offset
            else None
        )
        self.g_idx = (
            nn.Parameter(torch.zeros(in_features, dtype=torch.int32), False)
            if quant.act_order
            else None
        )
        self.bias = nn.Parameter(torch.zeros(out, dtype=dtype), False) if bias else None
        self.lora: LoraSlots | None = None  # set by workers.lora.device.attach_lora
        self._fast_path = False
        # torch's CPU kernel's copy of the weight, its group size and (scale, zero) pairs.
        self._kernel: tuple[torch.Tensor, int, torch.Tensor] | None = None

    def part_offset(self, index: int) -> int:
        return sum(self.output_sizes[:index])

    def scale_offset(self, index: int) -> int:
        """The first scale (and zero) row of part `index`: a row per weight row."""
        return self.part_offset(index)

    @property
    def fast_path(self) -> bool:
        return self._fast_path

    @fast_path.setter
    def fast_path(self, on: bool) -> None:
        """On: packs the loaded weight for torch's CPU kernel where it can run; off: frees it."""
        self._fast_path = on
        self._kernel = self._pack_for_kernel() if on else None

    def _kernel_group(self) -> int | None:
        """The kernel's group size for these scales, or None where it cannot run them."""
        if (
            self.weight_packed.device.type != "cpu"
            or self.dtype not in FAST_DTYPES
            or self.g_idx is not None
            or self.weight_packed.shape[0] % 16
            or self.in_features % 2
        ):
            return None
        if self.col_block is not None:
            return self.col_block if self.col_block in _KERNEL_GROUPS else None
        return next((g for g in _KERNEL_GROUPS if self.in_features % g == 0), None)

    def _pack_for_kernel(self) -> tuple[torch.Tensor, int, torch.Tensor] | None:
        group = self._kernel_group()
        if group is None:
            return None
        q = unpack_int4(self.weight_packed, self.in_features).to(torch.int32)
        weight = torch._convert_weight_to_int4pack_for_cpu(q, 1)
        groups = self.in_features // group
        repeat = groups // self.weight_scale.shape[1]  # > 1: per-channel scales
        scale = self.weight_scale.repeat_interleave(repeat, dim=1)
        zero = self.weight_zero.to(torch.float32).repeat_interleave(repeat, dim=1)
        # The kernel computes (q - 8) * scale + z with a float z: z = (8 - zero) * scale (+ the
        # float offset), rounded to bfloat16 like the scale.
        z = (SYMMETRIC_ZERO - zero) * scale
        if self.weight_offset is not None:
            z = z + self.weight_offset.repeat_interleave(repeat, dim=1)
        pairs = torch.stack((scale, z), dim=-1)
        return weight, group, pairs.transpose(0, 1).to(self.dtype).contiguous()

    def uses_fast_path(self, dtype: torch.dtype, rows: int) -> bool:
        """Whether an input of `rows` rows of `dtype` runs torch's CPU 4-bit GEMM."""
        return (
            self._kernel is not None
            and dtype in FAST_DTYPES
            and dtype == self.dtype
            and rows <= FAST_MAX_ROWS
        )

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """The whole weight in `dtype` (the reference path's, and tests')."""
        return dequantize_int4(
            self.weight_packed,
            self.weight_scale,
            self.weight_zero,
            self.in_features,
            dtype,
            self.g_idx,
            self.weight_offset,
        )

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self._kernel is not None and self.uses_fast_path(x.dtype, x.numel() // x.shape[-1]):
            weight, group, pairs = self._kernel
            flat = x.reshape(-1, x.shape[-1])
            y = torch._weight_int4pack_mm_for_cpu(flat, weight, group, pairs)
            y = y.view(*x.shape[:-1], -1)
            if bias is not None:
                y = y + bias
        else:
            y = F.linear(x, self.dequantized(x.dtype), bias)
        return with_lora(self, x, y)


class Int4ColumnParallelLinear(QuantizedColumnParallel, _Int4Linear):
    """ColumnParallelLinear over a packed int4 weight: this rank's rows, scales and zeros."""


class Int4RowParallelLinear(QuantizedRowParallel, _Int4Linear):
    """RowParallelLinear over a packed int4 weight: this rank's columns and their groups'
    scales and zeros, one all-reduce, the bias after it."""

    splits_input = True

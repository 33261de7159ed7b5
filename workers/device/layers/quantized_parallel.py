"""The tensor-parallel shapes of a quantized projection, shared by the FP8 (fp8_linear.py) and
int8 (int8_linear.py) layers: each of those holds its weight and scales and says how to
multiply by them (`matmul(x, bias)`, LoRA's delta included); these mixins make it a column-
parallel (this rank's output rows) or a row-parallel (this rank's input columns, one
all-reduce, the bias after it) layer, as ColumnParallelLinear / RowParallelLinear are for
full-precision weights."""

from __future__ import annotations

from typing import Any

import torch


class QuantizedColumnParallel:
    """A column-parallel projection over a quantized weight: this rank's rows and their
    scales; the bias (this rank's part of it) in the product."""

    bias: torch.Tensor | None
    matmul: Any  # the layer's product (fp8_linear.py, int8_linear.py); not defined here

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x, self.bias)


class QuantizedRowParallel:
    """A row-parallel projection over a quantized weight: this rank's columns and their
    scales, one all-reduce, the bias after it."""

    bias: torch.Tensor | None
    tp: Any
    matmul: Any  # the layer's product (fp8_linear.py, int8_linear.py); not defined here

    def __init__(
        self,
        in_features_per_rank: int,
        out_features: int,
        bias: bool,
        tp: Any,
        dtype: torch.dtype,
        quant: Any = None,
    ) -> None:
        super().__init__(in_features_per_rank, [out_features], bias, tp, dtype, quant)  # type: ignore[call-arg]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.tp.all_reduce(self.matmul(x, None))  # LoRA's delta before it, as unquantized
        return y if self.bias is None else y + self.bias


def with_lora(layer: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """`y` plus the layer's LoRA delta when adapters are active in this batch."""
    if layer.lora is not None and layer.lora.batch.active:
        return layer.lora.add_to(x, y)
    return y

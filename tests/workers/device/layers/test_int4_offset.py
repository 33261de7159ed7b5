"""The int4 layer's float offsets (workers/device/layers/int4_linear.py, `quant.offset`: GGUF's
Q4_K, w = scale * q + offset with zeros 0): the reference dequantizes to exactly that float32
formula, and CPU's 4-bit GEMM (the fast path, its float "zeros" carrying the offsets) equals
it in bfloat16 within bfloat16 rounding."""

from __future__ import annotations

import pytest
import torch

from workers.device.distributed import TPGroup
from workers.device.layers.int4_linear import (
    FAST_MAX_ROWS,
    Int4ColumnParallelLinear,
    Int4RowParallelLinear,
    pack_int4,
)
from workers.quantization import QuantizationConfig

GROUP = 32
QUANT = QuantizationConfig(
    method="gguf", strategy="group", weights="int4", weight_block_size=(1, GROUP), offset=True
)


def _layer(dtype: torch.dtype, rows: bool) -> torch.nn.Module:
    """A layer of Q4_K-like weights: scale d * sc > 0, offset -dmin * m around -7.5 scales, so
    the weights centre on zero and the offsets matter as much as the products."""
    if rows:
        layer = Int4RowParallelLinear(256, 64, False, TPGroup(), dtype, QUANT)
    else:
        layer = Int4ColumnParallelLinear(256, [48, 16], True, TPGroup(), dtype, QUANT)
        layer.bias.data.copy_(torch.randn(64).to(dtype))
    assert layer.weight_offset is not None and int(layer.weight_zero.max()) == 0
    groups = 256 // GROUP
    layer.weight_packed.data.copy_(pack_int4(torch.randint(0, 16, (64, 256))))
    scale = torch.rand(64, groups) * 0.01 + 0.001
    layer.weight_scale.data.copy_(scale)
    layer.weight_offset.data.copy_(-scale * (7.5 + torch.randn(64, groups)))
    layer.fast_path = True  # after loading, as workers/device/forward.py turns it on
    return layer


def test_the_reference_is_scale_times_q_plus_offset_in_float32() -> None:
    torch.manual_seed(0)
    layer = _layer(torch.float32, rows=False)
    q = torch.stack([(layer.weight_packed >> s) & 0xF for s in range(0, 32, 4)], -1).flatten(1)
    per = lambda t: t.repeat_interleave(GROUP, dim=1)  # noqa: E731
    want = q.float() * per(layer.weight_scale) + per(layer.weight_offset)
    assert torch.equal(layer.dequantized(torch.float32), want)
    x = torch.randn(3, 256)
    assert torch.equal(layer(x), torch.nn.functional.linear(x, want, layer.bias))


@pytest.mark.parametrize("rows", [False, True])
def test_the_fast_path_with_offsets_is_the_reference_up_to_rounding(rows: bool) -> None:
    torch.manual_seed(1)
    dtype = torch.bfloat16
    layer = _layer(dtype, rows)
    bias = 0 if layer.bias is None else layer.bias.float()
    for n in (1, 5, FAST_MAX_ROWS):
        x = torch.randn(n, 256, dtype=dtype)
        assert layer.uses_fast_path(dtype, n)
        fast = layer(x).float()
        layer.fast_path = False
        ref = layer(x).float()
        layer.fast_path = True
        exact = x.float() @ layer.dequantized(torch.float32).t() + bias
        scale = exact.abs().max().item()
        # bfloat16 keeps 8 bits: the weights', scales' and offsets' rounding, summed over 256
        # products, stays within a percent of the largest output (dropping the offsets does
        # not: they are a third of each weight's size).
        assert (fast - exact).abs().max().item() <= 1e-2 * scale, n
        assert (fast - ref).abs().max().item() <= 2e-2 * scale, n

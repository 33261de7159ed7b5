"""The int4 W4A16 layer (workers/device/layers/int4_linear.py) on its own: its packing is
compressed-tensors' (the package's pack_to_int32 / unpack_from_int32 as the reference), its
dequantization is (q - zero) * scale group by group (or by g_idx), and CPU's 4-bit GEMM (the
fast path) equals dequantize-then-matmul within bfloat16 rounding where it is taken, and is
not taken where it would lose (float32, big steps) or cannot run."""

from __future__ import annotations

import pytest
import torch

from workers.device.distributed import TPGroup
from workers.device.layers.int4_linear import (
    FAST_MAX_ROWS,
    Int4ColumnParallelLinear,
    Int4RowParallelLinear,
    dequantize_int4,
    pack_int4,
    unpack_int4,
)
from workers.quantization import QuantizationConfig


def test_packing_is_compressed_tensors_own() -> None:
    from compressed_tensors.compressors.pack_quantized.helpers import (
        pack_to_int32,
        unpack_from_int32,
    )

    torch.manual_seed(0)
    values = torch.randint(-8, 8, (24, 40), dtype=torch.int8)  # 40: five words a row
    theirs = pack_to_int32(values, 4)
    assert torch.equal(pack_int4((values + 8).to(torch.uint8)), theirs)
    assert torch.equal(unpack_int4(theirs, 40).to(torch.int8) - 8, values)
    assert torch.equal(unpack_from_int32(theirs, 4, torch.Size((24, 40))), values)


def test_dequantize_by_groups_and_by_g_idx() -> None:
    torch.manual_seed(1)
    q = torch.randint(0, 16, (8, 64), dtype=torch.uint8)
    scale, zero = torch.rand(8, 4) + 0.5, torch.randint(0, 16, (8, 4), dtype=torch.uint8)
    want = (q.float() - zero.float().repeat_interleave(16, 1)) * scale.repeat_interleave(16, 1)
    got = dequantize_int4(pack_int4(q), scale, zero, 64, torch.float32)
    assert torch.equal(got, want)
    g_idx = torch.randint(0, 4, (64,), dtype=torch.int32)  # activation order: any column's group
    idx = g_idx.long()
    want = (q.float() - zero.float()[:, idx]) * scale[:, idx]
    assert torch.equal(dequantize_int4(pack_int4(q), scale, zero, 64, torch.float32, g_idx), want)


def _layer(
    strategy: str, dtype: torch.dtype, zero_point: bool, rows: bool = False
) -> torch.nn.Module:
    quant = QuantizationConfig(
        method="compressed-tensors",
        strategy=strategy,
        weights="int4",
        weight_block_size=(1, 128),
        zero_point=zero_point,
    )
    if rows:
        layer = Int4RowParallelLinear(256, 128, True, TPGroup(), dtype, quant)
    else:
        layer = Int4ColumnParallelLinear(256, [96, 32], True, TPGroup(), dtype, quant)
    groups = layer.weight_scale.shape[1]
    layer.weight_packed.data.copy_(pack_int4(torch.randint(0, 16, (128, 256))))
    layer.weight_scale.data.copy_(torch.rand(128, groups) * 0.01 + 0.001)
    if zero_point:
        layer.weight_zero.data.copy_(torch.randint(0, 16, (128, groups)))
    layer.bias.data.copy_(torch.randn(128).to(dtype))
    layer.fast_path = True  # after loading, as workers/device/forward.py turns it on
    return layer


@pytest.mark.parametrize(
    ("strategy", "zero_point", "rows"),
    [("group", False, False), ("group", True, False), ("channel", False, True)],
)
def test_the_fast_path_is_the_reference_up_to_rounding(
    strategy: str, zero_point: bool, rows: bool
) -> None:
    torch.manual_seed(0)
    dtype = torch.bfloat16
    layer = _layer(strategy, dtype, zero_point, rows)
    for n in (1, 7, FAST_MAX_ROWS):
        x = torch.randn(n, 256, dtype=dtype)
        assert layer.uses_fast_path(dtype, n)
        fast = layer(x).float()
        layer.fast_path = False
        assert not layer.uses_fast_path(dtype, n)
        ref = layer(x).float()
        layer.fast_path = True
        exact = x.float() @ layer.dequantized(torch.float32).t() + layer.bias.float()
        scale = exact.abs().max().item()
        assert (fast - exact).abs().max().item() <= 1e-2 * scale, n
        assert (fast - ref).abs().max().item() <= 2e-2 * scale, n
    assert not layer.uses_fast_path(dtype, FAST_MAX_ROWS + 1)
    assert not layer.uses_fast_path(torch.float32, 1)


def test_float32_layers_and_odd_shapes_keep_the_reference() -> None:
    layer = _layer("group", torch.float32, False)
    assert layer._kernel is None and not layer.uses_fast_path(torch.float32, 1)
    quant = QuantizationConfig(
        method="compressed-tensors", strategy="group", weights="int4", weight_block_size=(1, 16)
    )
    small_groups = Int4ColumnParallelLinear(256, [128], False, TPGroup(), torch.bfloat16, quant)
    small_groups.fast_path = True  # the kernel takes groups of 32 to 256 columns only
    assert not small_groups.uses_fast_path(torch.bfloat16, 1)
    channel = QuantizationConfig(method="compressed-tensors", strategy="channel", weights="int4")
    odd_rows = Int4ColumnParallelLinear(256, [24], False, TPGroup(), torch.bfloat16, channel)
    odd_rows.fast_path = True  # the kernel wants a multiple of 16 output rows
    assert not odd_rows.uses_fast_path(torch.bfloat16, 1)

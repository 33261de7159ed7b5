"""FP8 block-scaled projections (workers/device/layers/fp8_linear.py): the blockwise
dequantization against a block-by-block loop, the scale rows of fused parts, and the bytes
the layers hold. Their outputs in a model are held to transformers by test_fp8_parity.py."""

from __future__ import annotations

import pytest
import torch

from tests.fp8_checkpoints import quantize_blocks
from workers.device.distributed import TPGroup
from workers.device.layers.fp8_linear import (
    FP8_DTYPE,
    Fp8ColumnParallelLinear,
    Fp8RowParallelLinear,
    dequantize,
    scale_rows,
)


def _loop_dequantize(w: torch.Tensor, s: torch.Tensor, parts: list[int]) -> torch.Tensor:
    """Each part's 128x128 blocks times their scale, one block at a time, in float32."""
    out, first = torch.empty(w.shape, dtype=torch.float32), 0
    row0 = 0
    for size in parts:
        for bi, r in enumerate(range(0, size, 128)):
            for bj, c in enumerate(range(0, w.shape[1], 128)):
                rows, cols = slice(row0 + r, row0 + min(r + 128, size)), slice(c, c + 128)
                out[rows, cols] = w[rows, cols].float() * s[first + bi, bj]
        first += -(-size // 128)
        row0 += size
    return out


def test_scale_rows_of_fused_parts() -> None:
    rows = scale_rows([256, 200, 128])
    assert rows.tolist() == [0] * 128 + [1] * 128 + [2] * 128 + [3] * 72 + [4] * 128


@pytest.mark.parametrize(("parts", "k"), [([256, 128, 128], 256), ([200, 72], 320)])
def test_dequantize_is_the_blockwise_product(parts: list[int], k: int) -> None:
    gen = torch.Generator().manual_seed(0)
    n = sum(parts)
    w = (torch.randn(n, k, generator=gen) * 3).to(FP8_DTYPE)
    s = torch.rand(sum(-(-p // 128) for p in parts), -(-k // 128), generator=gen) + 0.01
    got = dequantize(w, s, scale_rows(parts), torch.float32)
    assert torch.equal(got, _loop_dequantize(w, s, parts))
    # A stack of experts: each slot with its own grid.
    stack = dequantize(
        torch.stack([w, w]), torch.stack([s, 2 * s]), scale_rows(parts), torch.float32
    )
    assert torch.equal(stack[1], _loop_dequantize(w, 2 * s, parts))


def test_layers_hold_fp8_bytes_and_multiply_in_the_input_dtype() -> None:
    gen = torch.Generator().manual_seed(1)
    col = Fp8ColumnParallelLinear(256, [256, 128], True, TPGroup(), torch.float32)
    row = Fp8RowParallelLinear(384, 256, False, TPGroup(), torch.float32)
    for layer in (col, row):
        n, k = layer.weight.shape
        assert layer.weight.dtype == FP8_DTYPE and layer.weight.element_size() == 1
        q, s = quantize_blocks(torch.randn(n, k, generator=gen))
        layer.weight.data.copy_(q)
        assert layer.weight_scale_inv.shape == s.shape
        layer.weight_scale_inv.data.copy_(s)
    col.bias.data.normal_(generator=gen)
    x = torch.randn(5, 256, generator=gen)
    w = _loop_dequantize(col.weight, col.weight_scale_inv, [256, 128])
    torch.testing.assert_close(col(x), x @ w.T + col.bias, rtol=1e-5, atol=1e-5)
    h = torch.randn(3, 384, generator=gen)
    w = _loop_dequantize(row.weight, row.weight_scale_inv, [256])
    torch.testing.assert_close(row(h), h @ w.T, rtol=1e-5, atol=1e-5)
    assert row(h.bfloat16()).dtype == torch.bfloat16

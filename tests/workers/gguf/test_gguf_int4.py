"""GGUF's Q4_0 and Q4_K held 4-bit (workers/gguf/int4.py): the int4 layer's float32 reference
dequantization (workers/device/layers/int4_linear.py) of what they become reproduces gguf-py's
dequantizer bit for bit, on random blocks with random (signed, finite) float16 scales; Q4_0
both with its symmetric zero point and with float offsets (a file that also has Q4_K)."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from tests.workers.gguf.test_gguf_dequant import _random_blocks
from workers.device.layers.int4_linear import SYMMETRIC_ZERO, dequantize_int4, unpack_int4
from workers.gguf.dequant import FORMATS
from workers.gguf.int4 import int4_tensors

_FMT = {f.name: f for f in FORMATS.values()}


@pytest.mark.parametrize(("name", "offset"), [("Q4_0", False), ("Q4_0", True), ("Q4_K", True)])
def test_int4_form_dequantizes_as_gguf_py_does(name: str, offset: bool) -> None:
    rng = np.random.default_rng(3)
    rows, cols = 8, 2 * 256
    fmt = _FMT[name]
    blocks = _random_blocks(name, rows * cols // fmt.block, rng)
    want = gguf.quants.dequantize(
        blocks.reshape(rows, -1), getattr(gguf.GGMLQuantizationType, name)
    )
    raw = torch.from_numpy(blocks.reshape(-1).copy())
    t = int4_tensors(raw, fmt, rows, cols, offset=offset)
    assert t["weight_packed"].dtype == torch.int32 and t["weight_packed"].shape == (rows, cols // 8)
    assert t["weight_scale"].shape == (rows, cols // 32) and t["weight_shape"].tolist() == [
        rows,
        cols,
    ]
    assert ("weight_offset" in t) == offset
    zero = torch.full((rows, cols // 32), 0 if offset else SYMMETRIC_ZERO, dtype=torch.uint8)
    got = dequantize_int4(
        t["weight_packed"],
        t["weight_scale"],
        zero,
        cols,
        torch.float32,
        offset=t.get("weight_offset"),
    )
    assert np.array_equal(got.numpy(), want)  # bit for bit
    assert int(unpack_int4(t["weight_packed"], cols).max()) <= 15


def test_q4_k_without_offsets_is_refused() -> None:
    raw = torch.zeros(144, dtype=torch.uint8)
    with pytest.raises(ValueError, match="Q4_K, which needs float offsets"):
        int4_tensors(raw, _FMT["Q4_K"], 1, 256, offset=False)
    with pytest.raises(ValueError, match="stored as Q6_K, expected one of Q4_0, Q4_K"):
        int4_tensors(torch.zeros(210, dtype=torch.uint8), _FMT["Q6_K"], 1, 256, offset=True)


@pytest.mark.parametrize("name", ["Q4_0", "Q4_K"])
def test_the_bfloat16_fast_path_over_gguf_blocks_is_gguf_py_product_up_to_rounding(
    name: str,
) -> None:
    from tests.gguf_checkpoints import random_k_blocks
    from workers.device.distributed import TPGroup
    from workers.device.layers.int4_linear import Int4ColumnParallelLinear
    from workers.quantization import QuantizationConfig

    rng = np.random.default_rng(4)
    rows, cols = 64, 512
    qt = getattr(gguf.GGMLQuantizationType, name)
    if name == "Q4_K":  # gguf-py cannot quantize K-quants: random blocks centred on zero
        blocks = random_k_blocks(name, rows, cols, rng)
    else:
        blocks = gguf.quants.quantize(rng.normal(0, 0.02, (rows, cols)).astype(np.float32), qt)
    want = torch.from_numpy(gguf.quants.dequantize(blocks, qt))
    quant = QuantizationConfig(
        method="gguf", strategy="group", weights="int4", weight_block_size=(1, 32), offset=True
    )
    layer = Int4ColumnParallelLinear(cols, [rows], False, TPGroup(), torch.bfloat16, quant)
    raw = torch.from_numpy(np.ascontiguousarray(blocks).reshape(-1).copy())
    for key, t in int4_tensors(raw, _FMT[name], rows, cols, offset=True).items():
        if key != "weight_shape":
            getattr(layer, key).data.copy_(t)
    assert torch.equal(layer.dequantized(torch.float32), want)
    layer.fast_path = True
    x = torch.randn(4, cols, dtype=torch.bfloat16)
    assert layer.uses_fast_path(torch.bfloat16, 4)
    exact = x.float() @ want.t()
    err = (layer(x).float() - exact).abs().max().item()
    assert err <= 1e-2 * exact.abs().max().item()

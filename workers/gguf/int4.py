"""GGUF's 4-bit projections (Q4_0, Q4_K) kept 4-bit: the checkpoint tensors of the int4 W4A16
layer (workers/device/layers/int4_linear.py) in compressed-tensors' names, so the loader reads
them through workers/device/int4_targets.py (tensor-parallel slicing and its checks included).

Both formats are groups of 32 columns with one scale each, exactly the layer's form:
- Q4_0: w = d * (q - 8), q the stored nibble: scale d, the symmetric zero point 8.
- Q4_K: w = (d * sc) * q - dmin * m per sub-block of 32: scale d * sc and the float offset
  -dmin * m (`weight_offset`; the layer's zeros are then 0), which no uint8 zero point holds.

In a file that has any Q4_K projection every projection takes offsets (`offset`), Q4_0's then
-8 * d with zero 0: d * q and 8 * d are exact in float32 (an 11-bit float16 mantissa times a
4-bit integer), so their sum is d * (q - 8) exactly. Q4_K's products are exact too (11 + 6 + 4
bits), and the layer's float32 reference adds the offset after the product, as ggml's
dequantizer subtracts it: the weights are bit for bit gguf-py's (workers/gguf/dequant.py).
"""

from __future__ import annotations

import sys

import torch

from workers.device.layers.int4_linear import pack_int4
from workers.gguf.dequant import INT4_GROUP, INT4_TYPES, BlockFormat, _blocks, _half, q4_k_parts


def _pack(q: torch.Tensor) -> torch.Tensor:
    """Values 0..15 uint8 [rows, cols] -> int32 [rows, cols / 8], the layer's words."""
    if sys.byteorder == "little":  # a word's bytes hold values (0, 1), (2, 3), ...
        return (q[:, 0::2] | (q[:, 1::2] << 4)).contiguous().view(torch.int32)
    return pack_int4(q)


def _q4_0(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # Element j of a block is byte j's low nibble, element j + 16 its high one.
    qs = b[:, 2:]
    d = _half(b[:, :2])
    return torch.cat([qs & 0xF, qs >> 4], dim=1), d, -8 * d


def _q4_k(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    q, ds, dm = q4_k_parts(b)  # [n, 8, 32] uint8, [n, 8, 1] float32 each
    return q.reshape(-1, 256), ds.reshape(-1, 8), -dm.reshape(-1, 8)


_SPLIT = {"Q4_0": _q4_0, "Q4_K": _q4_k}


def int4_tensors(
    raw: torch.Tensor, fmt: BlockFormat, rows: int, cols: int, offset: bool
) -> dict[str, torch.Tensor]:
    """A Q4_0 or Q4_K matrix's `weight_packed` int32 [rows, cols / 8], `weight_scale` float32
    [rows, cols / 32] and, with `offset`, `weight_offset` float32 [rows, cols / 32] (without,
    Q4_0 only: its zero point is the layer's symmetric 8)."""
    if fmt.name not in _SPLIT:
        raise ValueError(f"stored as {fmt.name}, expected one of {', '.join(INT4_TYPES)}")
    q, scale, shift = _SPLIT[fmt.name](_blocks(raw, fmt))
    groups = cols // INT4_GROUP
    out = {
        "weight_packed": _pack(q.reshape(rows, cols)),
        "weight_scale": scale.reshape(rows, groups),
        "weight_shape": torch.tensor([rows, cols], dtype=torch.int64),
    }
    if offset:
        out["weight_offset"] = shift.reshape(rows, groups)
    elif fmt.name != "Q4_0":
        raise ValueError(f"stored as {fmt.name}, which needs float offsets")
    return out

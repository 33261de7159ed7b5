"""GGML tensor formats -> torch tensors: the float types as stored, the block-quantized ones
(Q8_0, Q4_0, Q4_K, Q6_K) dequantized in float32, and Q8_0 also split into int8 values and one
scale per 32 columns (what workers/device/layers/int8_linear.py holds).

Written from the GGUF format's block layouts (ggml's `block_q8_0` etc.), computed in the
order ggml's reference dequantizer computes (scale products in float32 first, then times the
quantized value), so the float32 weights are those gguf-py's and transformers' loader make;
tests/workers/gguf/test_gguf_dequant.py holds each type to gguf-py's dequantizer.

Every function takes the tensor's raw bytes as a uint8 tensor of whole blocks and returns
`rows x cols` values (`cols` is GGUF's first dimension, ne0: a row never splits a block).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class BlockFormat:
    """One GGML type: elements per block, bytes per block."""

    name: str
    block: int
    nbytes: int


# The types kvray reads, by GGML type id (ggml.h's `enum ggml_type`).
FORMATS: dict[int, BlockFormat] = {
    0: BlockFormat("F32", 1, 4),
    1: BlockFormat("F16", 1, 2),
    2: BlockFormat("Q4_0", 32, 2 + 16),
    8: BlockFormat("Q8_0", 32, 2 + 32),
    12: BlockFormat("Q4_K", 256, 2 + 2 + 12 + 128),
    14: BlockFormat("Q6_K", 256, 128 + 64 + 16 + 2),
    30: BlockFormat("BF16", 1, 2),
}
FLOAT_TYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
Q8_0_GROUP = 32  # columns per Q8_0 scale
# The types held 4-bit in the int4 layer (workers/gguf/int4.py), a scale per 32 columns.
INT4_TYPES = ("Q4_0", "Q4_K")
INT4_GROUP = 32


def _half(b: torch.Tensor) -> torch.Tensor:
    """[n, 2] little-endian float16 bytes -> [n, 1] float32."""
    return b.contiguous().view(torch.float16).float()


def _q8_0(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 values [n, 32] and their float32 scale [n, 1]: w = scale * q."""
    return b[:, 2:].contiguous().view(torch.int8), _half(b[:, :2])


def _q4_0(b: torch.Tensor) -> torch.Tensor:
    # 16 bytes of nibbles: element j is byte j's low nibble, element j + 16 its high one; the
    # stored nibble is q + 8.
    qs = b[:, 2:]
    q = torch.cat([qs & 0xF, qs >> 4], dim=1).to(torch.int8) - 8
    return _half(b[:, :2]) * q.float()


def q4_k_parts(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4_K blocks [n, 144] -> q uint8 [n, 8, 32] (0..15), d * scale_j and dmin * min_j
    float32 [n, 8, 1] (workers/gguf/int4.py keeps them apart)."""
    # A super-block of 8 sub-blocks of 32: w = d * scale_j * q - dmin * min_j, with 6-bit
    # scale_j and min_j packed into 12 bytes (sub-blocks 0-3 in the low 6 bits of bytes 0-3 and
    # 4-7; 4-7 in the nibbles of bytes 8-11 plus the top 2 bits of bytes 0-3 and 4-7).
    n = b.shape[0]
    d, dmin, s = _half(b[:, 0:2]), _half(b[:, 2:4]), b[:, 4:16]
    lo_s, lo_m, packed = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    scale = torch.cat([lo_s & 63, (packed & 0xF) | ((lo_s >> 6) << 4)], dim=1)
    mins = torch.cat([lo_m & 63, (packed >> 4) | ((lo_m >> 6) << 4)], dim=1)
    # 128 bytes in 4 runs of 32: run i holds sub-block 2i in its low nibbles, 2i + 1 in its high.
    qs = b[:, 16:].reshape(n, 4, 1, 32)
    q = torch.cat([qs & 0xF, qs >> 4], dim=2).reshape(n, 8, 32)
    return q, (d * scale.float()).unsqueeze(-1), (dmin * mins.float()).unsqueeze(-1)


def _q4_k(b: torch.Tensor) -> torch.Tensor:
    q, ds, dm = q4_k_parts(b)
    return (ds * q.float() - dm).reshape(b.shape[0], 256)


_Q6_K_SHIFTS = (0, 2, 4, 6)


def _q6_k(b: torch.Tensor) -> torch.Tensor:
    # Two halves of 128 values, each four groups g of 32: the low 4 bits from 64 bytes of
    # nibbles (group g: nibble g // 2 of bytes 32 * (g % 2) ... + 32), the high 2 bits from bits
    # 2g..2g+1 of 32 bytes; q - 32 times d times an int8 scale per 16 values.
    n = b.shape[0]
    ql = b[:, :128].reshape(n, 2, 1, 2, 32)
    low = torch.cat([ql & 0xF, ql >> 4], dim=2).reshape(n, 2, 4, 32)
    qh = b[:, 128:192].reshape(n, 2, 1, 32)
    shifts = torch.tensor(_Q6_K_SHIFTS, dtype=torch.uint8, device=b.device).view(1, 1, 4, 1)
    high = (qh >> shifts) & 3
    q = (low | (high << 4)).to(torch.int16) - 32
    scales = b[:, 192:208].contiguous().view(torch.int8).float()
    ds = (_half(b[:, 208:210]) * scales).unsqueeze(-1)  # [n, 16, 1]
    return (ds * q.reshape(n, 16, 16).float()).reshape(n, 256)


def _q8_0_float(b: torch.Tensor) -> torch.Tensor:
    q, d = _q8_0(b)
    return d * q.float()


_DEQUANT = {"Q8_0": _q8_0_float, "Q4_0": _q4_0, "Q4_K": _q4_k, "Q6_K": _q6_k}


def _blocks(raw: torch.Tensor, fmt: BlockFormat) -> torch.Tensor:
    if raw.numel() % fmt.nbytes:
        raise ValueError(f"{raw.numel()} bytes are not whole {fmt.name} blocks")
    return raw.reshape(-1, fmt.nbytes)


def dequantize(raw: torch.Tensor, fmt: BlockFormat, shape: tuple[int, ...]) -> torch.Tensor:
    """`raw` (uint8 bytes of a tensor of `fmt`) as a tensor of `shape` (rows first): a float
    type in its own dtype, a quantized one in float32."""
    if fmt.name in FLOAT_TYPES:
        return raw.contiguous().view(FLOAT_TYPES[fmt.name]).reshape(shape)
    return _DEQUANT[fmt.name](_blocks(raw, fmt)).reshape(shape)


def q8_0_int8(raw: torch.Tensor, rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A Q8_0 matrix as int8 [rows, cols] and float32 scales [rows, cols / 32]."""
    q, d = _q8_0(_blocks(raw, FORMATS[8]))
    return q.reshape(rows, cols), d.reshape(rows, cols // Q8_0_GROUP)

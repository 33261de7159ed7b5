"""Weights packed for the bfloat16-weight GEMMs: csrc/bf16_linear.c (FMA, AVX2 or AVX-512)
and csrc/amx_linear.c (AMX tiles)."""

from __future__ import annotations

import torch

# Output features per panel of the packed bfloat16 weight (NB in csrc/bf16_linear.c, PANEL
# in csrc/amx_linear.c), and k per AMX weight tile (CHUNK).
BF16_PANEL = 32
AMX_CHUNK = 32


def pack_bf16_weight(weight: torch.Tensor, amx: bool = False) -> torch.Tensor | None:
    """`weight` [N, K] (float32) packed for `bf16_linear` (int32 words), or with `amx` for
    `amx_linear` (int16), or None when some value is not a bfloat16 (widening back must give
    every value exactly, or the layer would change).

    A float32 is a bfloat16 exactly when the low 16 bits of its pattern are zero; the high
    16 are then the bfloat16. Layout for csrc/bf16_linear.c: panels of 32 output features,
    each [K][16] int32 words, word j holding feature j's bfloat16 bits in its low half and
    feature 16 + j's in its high half; the last panel zero-padded. For csrc/amx_linear.c:
    N and K zero-padded to multiples of 32; per panel of 32 features, per chunk of 32 k, two
    tiles (features 0-15, 16-31) of [16 pairs of k][16 features][2]."""
    bits = weight.detach().contiguous().view(torch.int32)
    if bool((bits & 0xFFFF).any()):
        return None
    n, k = bits.shape
    panels = -(-n // BF16_PANEL)
    if amx:
        chunks = -(-k // AMX_CHUNK)
        high = bits.view(torch.int16)[:, 1::2]  # little-endian: a float's upper half
        padded = high.new_zeros(panels * BF16_PANEL, chunks * AMX_CHUNK)
        padded[:n, :k] = high
        tiles = padded.view(panels, 2, 16, chunks, AMX_CHUNK // 2, 2)  # p, half, n, c, pair, e
        return tiles.permute(0, 3, 1, 4, 2, 5).contiguous()  # p, c, half, pair, n, e
    if panels * BF16_PANEL != n:
        bits = torch.cat([bits, bits.new_zeros(panels * BF16_PANEL - n, k)])
    halves = bits.view(panels, 2, BF16_PANEL // 2, k)
    # Feature j's high 16 bits moved down (>> is arithmetic: mask), feature 16 + j's as they are.
    words = ((halves[:, 0] >> 16) & 0xFFFF) | halves[:, 1]  # [P, 16, K]
    return words.transpose(1, 2).contiguous()  # [P, K, 16]


def amx_packed(packed: torch.Tensor) -> bool:
    """Whether `packed` is `pack_bf16_weight`'s AMX layout (for csrc/amx_linear.c)."""
    return packed.dtype == torch.int16

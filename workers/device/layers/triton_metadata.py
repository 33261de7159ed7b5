"""The step's metadata for the Triton attention backend (workers/device/layers/triton_attention.py),
built once per step on the host and moved to the device in one copy; every layer reads it.

Kept free of triton imports: the model runner builds it without loading the kernels.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

# Rows of a program's tile: tl.dot wants at least 16 on every side on GPUs.
MIN_TILE_ROWS = 16


@dataclass(frozen=True)
class TritonMetadata:
    block_tables: torch.Tensor  # [S, max_blocks] int32
    seq_lens: torch.Tensor  # [S] int32: cached context + this step's tokens
    cu_seqlens_q: torch.Tensor  # [S + 1] int32: each sequence's first row in the batch
    prog_seq: torch.Tensor  # [P] int32: the sequence of each program (`program_table`)
    prog_qoff: torch.Tensor  # [P] int32: its first query's offset in the sequence's chunk
    block_q: int  # query tokens per program


def block_q_for(num_heads: int, num_kv_heads: int) -> int:
    """Query tokens per program: enough that a tile (query tokens x the query heads of one KV
    head, rounded up to a power of two) has MIN_TILE_ROWS rows."""
    group = 1 << max(0, (num_heads // num_kv_heads - 1).bit_length())
    return max(1, MIN_TILE_ROWS // group)


def program_table(query_lens: np.ndarray, block_q: int) -> tuple[np.ndarray, np.ndarray]:
    """(sequence, first query offset) of each program: a sequence's chunk is cut into pieces
    of block_q query tokens."""
    query_lens = np.asarray(query_lens, dtype=np.int64)
    counts = -(-query_lens // block_q)
    seq = np.repeat(np.arange(len(query_lens), dtype=np.int32), counts)
    first = np.cumsum(counts) - counts
    qoff = (np.arange(len(seq), dtype=np.int64) - np.repeat(first, counts)) * block_q
    return seq, qoff.astype(np.int32)


def build_triton_metadata(
    query_lens: Sequence[int],
    seq_lens: Sequence[int],
    block_ids: Sequence[Sequence[int]],
    block_q: int,
    device: torch.device,
) -> TritonMetadata:
    """Sequences in the batch's row order; one host-to-device copy for all of it."""
    s = len(query_lens)
    qlens = np.asarray(query_lens, dtype=np.int64)
    max_blocks = max(len(b) for b in block_ids)
    seq, qoff = program_table(qlens, block_q)
    p = len(seq)
    # One int32 buffer: tables, seq lens, cu_seqlens, program table.
    buf = np.zeros(s * max_blocks + s + (s + 1) + 2 * p, dtype=np.int32)
    tables = buf[: s * max_blocks].reshape(s, max_blocks)
    for r, b in enumerate(block_ids):
        tables[r, : len(b)] = b
    o = s * max_blocks
    buf[o : o + s] = seq_lens
    buf[o + s + 1 : o + 2 * s + 1] = np.cumsum(qlens)
    o += 2 * s + 1
    buf[o : o + p] = seq
    buf[o + p :] = qoff
    t = torch.from_numpy(buf)
    if device.type == "cuda":
        t = t.pin_memory().to(device, non_blocking=True)
    o = s * max_blocks
    return TritonMetadata(
        block_tables=t[:o].view(s, max_blocks),
        seq_lens=t[o : o + s],
        cu_seqlens_q=t[o + s : o + 2 * s + 1],
        prog_seq=t[o + 2 * s + 1 : o + 2 * s + 1 + p],
        prog_qoff=t[o + 2 * s + 1 + p :],
        block_q=block_q,
    )

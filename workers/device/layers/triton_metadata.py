"""The step's metadata for the Triton attention backend (workers/device/layers/triton_attention.py):
built once per step on the host with the step's other inputs (workers/device/triton_inputs.py)
and moved to the device in the same one copy; every layer reads it.

Kept free of triton imports: the model runner builds it without loading the kernels.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

# Rows of a program's tile: tl.dot wants at least 16 on every side on GPUs.
MIN_TILE_ROWS = 16


@dataclass(frozen=True)
class TritonMetadata:
    block_tables: torch.Tensor  # [S, max_blocks] int64
    seq_lens: torch.Tensor  # [S] int64: cached context + this step's tokens
    cu_seqlens_q: torch.Tensor  # [S + 1] int64: each sequence's first row in the batch
    prog_seq: torch.Tensor  # [P] int64: the sequence of each program (`program_table`)
    prog_qoff: torch.Tensor  # [P] int64: its first query's offset in the sequence's chunk
    block_q: int  # query tokens per program
    # A decode step padded to this many rows, laid out as the CUDA graph of that size reads
    # it (workers/device/decode_graphs.py); 0: not padded.
    graph_size: int = 0
    # [T] int64: 1 for each of the step's tokens, 0 for each padding row (the experts' token
    # counts read it); None: every row is a token.
    real_rows: torch.Tensor | None = None


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

"""The triton backend's step inputs: every integer the step's forward reads, built with numpy
(per-sequence work, no per-token Python) straight into the worker's persistent step buffer
and uploaded in one copy (workers/device/step_buffers.py).

Rows are sequences, decodes first, then prefill chunks (the torch path's order,
workers/device/model_runner.py). The buffer's layout, in order:

    input ids [T] | positions [T] | KV slots [T] | real rows [T] | seq lens [S]
    | cu_seqlens_q [S + 1] | program table: sequences [P], query offsets [P]
    | block tables [S, W] | logits rows [L]

A decode-only step that a whole-step CUDA graph serves (workers/device/decode_graphs.py) is
padded to the graph's size B (T = S = P = B) and its tables to the graphs' width, so that
every piece but the logits rows (read outside the graph) sits where the graph of size B
reads it. Padding rows do nothing: token 0 at position 0, no KV slot (-1), no query tokens
and no context, so the kernels skip them; their hidden states are never read, and "real
rows" (1 per token, 0 per padding row) keeps them out of the experts' token counts.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain

import numpy as np
import torch

from workers.compile_sizes import padded_size
from workers.device.layers.attention import AttentionMetadata
from workers.device.layers.triton_metadata import TritonMetadata, program_table
from workers.device.model_runner import (
    ModelInput,
    SeqState,
    prompt_and_pool_chunks,
    sample_row,
)
from workers.device.step_buffers import StepBuffers


@dataclass(frozen=True)
class DecodePadding:
    """What the whole-step decode graphs were captured for."""

    sizes: tuple[int, ...]  # batch sizes, ascending
    width: int  # block-table columns


def triton_layout(
    rows: int, tokens: int, programs: int, width: int, logits: int
) -> list[tuple[int, ...]]:
    """The shapes of the step buffer's pieces, in order (see the module doc)."""
    return [
        (tokens,),
        (tokens,),
        (tokens,),
        (tokens,),
        (rows,),
        (rows + 1,),
        (programs,),
        (programs,),
        (rows, width),
        (logits,),
    ]


def table_width(max_model_len: int, block_size: int, num_blocks: int) -> int:
    """Block-table columns enough for any sequence: its longest context's blocks."""
    return max(1, min(-(-max_model_len // block_size), num_blocks))


def buffer_capacity(max_tokens: int, max_seqs: int, width: int) -> int:
    """Integers the step buffer needs at most: a step has at most `max_tokens` tokens (or a
    decode graph's size, not above `max_seqs`), `max_seqs` sequences, one program per
    `block_q` query tokens of a sequence (at most tokens + sequences), and logits rows for
    its samples and prompt logprobs (at most tokens + sequences)."""
    t, s = max(max_tokens, max_seqs), max_seqs
    return 4 * t + 2 * s + 1 + 2 * (t + s) + s * width + (t + s)


def prepare_triton_inputs(
    states: list[SeqState],
    block_size: int,
    block_q: int,
    buffers: StepBuffers,
    padding: DecodePadding | None = None,
) -> ModelInput:
    decodes = [s for s in states if s.num_scheduled == 1]
    prefills = [s for s in states if s.num_scheduled > 1]
    rows = decodes + prefills
    s = len(rows)
    qlens = np.fromiter((r.num_scheduled for r in rows), dtype=np.int64, count=s)
    starts = np.fromiter((r.num_computed_tokens for r in rows), dtype=np.int64, count=s)
    cu = np.zeros(s + 1, dtype=np.int64)
    np.cumsum(qlens, out=cu[1:])
    t = int(cu[-1])

    logits_idx: list[int] = []
    sample_states: list[SeqState] = []
    chunk_rows: list[tuple[SeqState, int]] = []
    for r, st in enumerate(rows):
        chunk_rows.append((st, int(cu[r])))
        if st.num_computed_tokens + st.num_scheduled == len(st.token_ids):
            sample_row(st, int(cu[r + 1]) - 1, logits_idx, sample_states)
    prompt_chunks, pool_chunks = prompt_and_pool_chunks(chunk_rows, logits_idx)
    lora_rows = [(st.lora_slot, r, st.num_scheduled) for st, r in chunk_rows if st.lora_slot >= 0]

    graph = 0
    if padding is not None and not prefills and not lora_rows:
        graph = padded_size(s, padding.sizes) or 0
    if graph:
        n_rows = n_tokens = n_programs = graph
        width = padding.width
    else:
        prog_seq, prog_qoff = program_table(qlens, block_q)
        n_rows, n_tokens, n_programs = s, t, len(prog_seq)
        width = max(len(r.block_ids) for r in rows)
    ids, pos, slots, real, seq_lens, cu_q, p_seq, p_qoff, tables, logits = buffers.host_views(
        triton_layout(n_rows, n_tokens, n_programs, width, len(logits_idx))
    )
    ids[:t] = np.fromiter(
        chain.from_iterable(
            r.token_ids[r.num_computed_tokens : r.num_computed_tokens + r.num_scheduled]
            for r in rows
        ),
        dtype=np.int64,
        count=t,
    )
    for r, st in enumerate(rows):
        tables[r, : len(st.block_ids)] = st.block_ids
    p = pos[:t]
    p[:] = np.arange(t, dtype=np.int64) + np.repeat(starts - cu[:-1], qlens)
    slots[:t] = tables[np.repeat(np.arange(s), qlens), p // block_size] * block_size
    slots[:t] += p % block_size
    seq_lens[:s] = starts + qlens
    cu_q[: s + 1] = cu
    real[:t] = 1
    if graph:
        ids[t:] = 0
        pos[t:] = 0
        slots[t:] = -1
        real[t:] = 0
        seq_lens[s:] = 0
        cu_q[s + 1 :] = t
        p_seq[:] = np.arange(graph)
        p_qoff[:] = 0
    else:
        p_seq[:] = prog_seq
        p_qoff[:] = prog_qoff
    logits[:] = logits_idx
    d_ids, d_pos, meta, d_logits = upload_step(buffers, len(decodes), block_q, graph)
    return ModelInput(
        input_ids=d_ids,
        positions=d_pos,
        meta=meta,
        logits_indices=d_logits,
        sample_states=sample_states,
        prompt_chunks=prompt_chunks,
        pool_chunks=pool_chunks,
        lora_rows=lora_rows,
    )


def upload_step(
    buffers: StepBuffers, num_decodes: int, block_q: int, graph_size: int
) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
    """Uploads the step written into `buffers`' host views (in `triton_layout` order); returns
    its input ids, positions, attention metadata and logits rows, views of the device buffer."""
    d_ids, d_pos, d_slots, d_real, d_lens, d_cu, d_pseq, d_pqoff, d_tables, d_logits = (
        buffers.upload()
    )
    meta = AttentionMetadata(
        slot_mapping=d_slots,
        num_decodes=num_decodes,
        decode_block_tables=None,
        decode_mask=None,
        prefills=[],
        triton=TritonMetadata(d_tables, d_lens, d_cu, d_pseq, d_pqoff, block_q, graph_size, d_real),
    )
    return d_ids, d_pos, meta, d_logits

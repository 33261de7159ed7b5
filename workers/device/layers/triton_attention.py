"""Paged attention in Triton: one launch per layer for the whole step, K/V read in place.

The step's batch is flat: T query tokens, sequence s owning rows cu_seqlens_q[s] ..
cu_seqlens_q[s+1] (a decode is a chunk of one). Sequence s attends over seq_lens[s] tokens
(its cached context, then its new tokens, the last q_len of them), found through its row of
the block tables; the query at chunk offset i sits at position seq_lens[s] - q_len + i and
attends to positions 0 .. that position (and, with a sliding window W, only the last W).

Work split: a program takes BLOCK_Q consecutive query tokens of one sequence and one KV head,
with all the query heads that share that KV head (GQA/MQA: their rows share every K/V load),
so its tile has BLOCK_Q * group rows. Which sequence and chunk offset a program handles comes
from a small table the model runner builds once per step on the host
(workers/device/layers/triton_metadata.py),
which keeps the kernel free of searches. The program walks K/V a tile of TILE tokens at a
time (a tile may span several cache blocks: each token's block is looked up), with an online
softmax in float32, and stops at its last query's position: decodes and prefill chunks, with
or without a cached prefix, take the same code.

This module imports triton: import it only where the triton backend was chosen. Triton reads
TRITON_INTERPRET when a kernel is defined (`@triton.jit`), so the interpreter (CPU tests)
must be on before this module is first imported.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from workers.device.layers import kv_quant
from workers.device.layers.triton_metadata import TritonMetadata


@triton.jit
def _store_kv_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    stride_kt,
    stride_vt,
    stride_cb,
    stride_cs,
    BLOCK_SIZE: tl.constexpr,
    ROW: tl.constexpr,  # kv_heads * head_dim: a token's K (or V), contiguous
    ROW_P: tl.constexpr,  # ROW rounded up to a power of two
):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t)
    if slot >= 0:  # a negative slot: a padding token with nowhere to go
        offs = tl.arange(0, ROW_P)
        m = offs < ROW
        dst = (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_cs + offs
        tl.store(k_cache_ptr + dst, tl.load(k_ptr + t * stride_kt + offs, mask=m), mask=m)
        tl.store(v_cache_ptr + dst, tl.load(v_ptr + t * stride_vt + offs, mask=m), mask=m)


def store_kv(
    k: torch.Tensor,  # [T, KH, D]
    v: torch.Tensor,
    k_cache: torch.Tensor,  # [num_blocks, block_size, KH, D], each token's [KH, D] contiguous
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T] int64
    scales: tuple[float, float] = (1.0, 1.0),  # an FP8 cache's K and V scales
) -> None:
    """Writes the step's new K/V into their cache slots: one launch for both."""
    t = k.shape[0]
    if t == 0:
        return
    if k_cache.dtype == torch.float8_e4m3fn:
        # Rounded by torch (kv_quant.quantize), as the torch path stores them; the kernel
        # copies bytes. One rounding everywhere, and a checked one: Triton's interpreter
        # rounds a mantissa carry into the exponent wrongly (7.99 to 4.0, not 8.0).
        k, v = kv_quant.quantize(k, scales[0]), kv_quant.quantize(v, scales[1])
    k, v = k.reshape(t, -1), v.reshape(t, -1)  # rows of KH * D; a copy only if not viewable
    if k.stride(1) != 1 or v.stride(1) != 1:
        k, v = k.contiguous(), v.contiguous()
    row = k.shape[1]
    _store_kv_kernel[(t,)](
        k,
        v,
        k_cache,
        v_cache,
        slot_mapping,
        k.stride(0),
        v.stride(0),
        k_cache.stride(0),
        k_cache.stride(1),
        BLOCK_SIZE=k_cache.shape[1],
        ROW=row,
        ROW_P=triton.next_power_of_2(row),
    )


@triton.jit
def _paged_attention_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    cu_seqlens_q_ptr,
    prog_seq_ptr,
    prog_qoff_ptr,
    scale,
    k_scale,  # an FP8 cache's scales (with FP8)
    v_scale,
    window,  # sliding window in tokens (with SLIDING)
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_bt,
    GROUP: tl.constexpr,  # query heads per KV head
    GROUP_P: tl.constexpr,  # GROUP rounded up to a power of two
    BLOCK_Q: tl.constexpr,  # query tokens per program
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_P: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,  # the cache's tokens per block
    TILE: tl.constexpr,  # K/V tokens per iteration
    SLIDING: tl.constexpr,  # attend only to the last `window` positions
    IEEE: tl.constexpr,  # float32 inputs: exact float32 products (no TF32)
    FP8: tl.constexpr,  # an FP8 cache: its elements times the scales, in q's dtype
):
    pid = tl.program_id(0)
    kvh = tl.program_id(1)
    seq = tl.load(prog_seq_ptr + pid)
    q_off = tl.load(prog_qoff_ptr + pid)  # first query of this program, in its chunk
    q_begin = tl.load(cu_seqlens_q_ptr + seq)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_begin
    total = tl.load(seq_lens_ptr + seq)
    ctx = total - q_len  # tokens cached before this step's chunk

    rows = tl.arange(0, BLOCK_Q * GROUP_P)
    qi = q_off + rows // GROUP_P  # query index in the chunk
    g = rows % GROUP_P
    row_ok = (qi < q_len) & (g < GROUP)
    head = kvh * GROUP + g
    d = tl.arange(0, HEAD_DIM_P)
    d_ok = d < HEAD_DIM
    q = tl.load(
        q_ptr + (q_begin + qi)[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
        mask=row_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    q_pos = ctx + qi  # each row's position in its sequence

    # K/V needed: up to the last query's position; with a window, from the first query's
    # window start.
    last_q = tl.minimum(q_off + BLOCK_Q, q_len) - 1
    kv_end = ctx + last_q + 1
    kv_start = 0
    if SLIDING:
        kv_start = (tl.maximum(ctx + q_off - window + 1, 0) // TILE) * TILE

    m_i = tl.full([BLOCK_Q * GROUP_P], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_Q * GROUP_P], dtype=tl.float32)
    acc = tl.zeros([BLOCK_Q * GROUP_P, HEAD_DIM_P], dtype=tl.float32)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    for start in range(kv_start, kv_end, TILE):
        pos = start + tl.arange(0, TILE)
        pos_ok = pos < kv_end
        blk = tl.load(table + pos // BLOCK_SIZE, mask=pos_ok, other=0).to(tl.int64)
        kv_off = blk * stride_cb + (pos % BLOCK_SIZE) * stride_cs + kvh * stride_ch
        kv_mask = pos_ok[:, None] & d_ok[None, :]
        k = tl.load(k_cache_ptr + kv_off[:, None] + d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_cache_ptr + kv_off[:, None] + d[None, :], mask=kv_mask, other=0.0)
        if FP8:
            k = (k.to(tl.float32) * k_scale).to(q.dtype)
            v = (v.to(tl.float32) * v_scale).to(q.dtype)
        # Products in the cache's dtype, sums in float32. float32 models ask for IEEE
        # products: a GPU's default for float32 dots is TF32 (10-bit mantissas), which
        # would cost float32 its parity with transformers.
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale  # [rows, TILE]
        else:
            s = tl.dot(q, tl.trans(k)) * scale
        attend = (pos[None, :] <= q_pos[:, None]) & pos_ok[None, :]
        if SLIDING:
            attend = attend & (pos[None, :] > q_pos[:, None] - window)
        s = tl.where(attend, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A row with nothing to attend yet keeps -inf: shift by 0 instead (exp(-inf) = 0).
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(s - m_shift[:, None])
        alpha = tl.exp(m_i - m_shift)
        l_i = l_i * alpha + tl.sum(p, 1)
        if IEEE:
            pv = tl.dot(p, v, input_precision="ieee")
        else:  # as flash attention does: the probabilities rounded to the cache's dtype
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    out = acc / l_safe[:, None]
    tl.store(
        out_ptr + (q_begin + qi)[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=row_ok[:, None] & d_ok[None, :],
    )


def paged_attention(
    q: torch.Tensor,  # [T, H, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, KH, D]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [S, max_blocks] int
    seq_lens: torch.Tensor,  # [S] int32 or int64: context + new tokens
    cu_seqlens_q: torch.Tensor,  # [S + 1] int32 or int64
    prog_seq: torch.Tensor,  # [P] int32 or int64 (triton_metadata.program_table)
    prog_qoff: torch.Tensor,  # [P] int32 or int64
    block_q: int,
    scale: float,
    window: int = 0,
    out: torch.Tensor | None = None,
    tile: int | None = None,
    scales: tuple[float, float] = (1.0, 1.0),  # an FP8 cache's K and V scales
) -> torch.Tensor:
    """Attention of every query row of the step: one launch. `block_q` must be the one
    `program_table` was built with."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    group = num_heads // num_kv_heads
    if out is None:
        out = torch.empty_like(q)
    if prog_seq.numel() == 0:
        return out
    if tile is None:
        tile = max(block_size, 16) if block_size <= 64 else 64
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(3) == 1
    assert q.stride(2) == 1 and out.stride(2) == 1
    grid = (prog_seq.numel(), num_kv_heads)
    _paged_attention_kernel[grid](
        q,
        k_cache,
        v_cache,
        out,
        block_tables,
        seq_lens,
        cu_seqlens_q,
        prog_seq,
        prog_qoff,
        scale,
        float(scales[0]),
        float(scales[1]),
        window,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_tables.stride(0),
        GROUP=group,
        GROUP_P=triton.next_power_of_2(group),
        BLOCK_Q=block_q,
        HEAD_DIM=head_dim,
        HEAD_DIM_P=triton.next_power_of_2(head_dim),
        BLOCK_SIZE=block_size,
        TILE=tile,
        SLIDING=window > 0,
        IEEE=q.dtype == torch.float32,
        FP8=k_cache.dtype == torch.float8_e4m3fn,
    )
    return out


def paged_attention_step(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: TritonMetadata,
    scale: float,
    scales: tuple[float, float] = (1.0, 1.0),
    window: int = 0,
) -> torch.Tensor:
    """`paged_attention` with the step's metadata; `scales`: an FP8 cache's K and V scales."""
    return paged_attention(
        q,
        k_cache,
        v_cache,
        meta.block_tables,
        meta.seq_lens,
        meta.cu_seqlens_q,
        meta.prog_seq,
        meta.prog_qoff,
        meta.block_q,
        scale,
        window,
        scales=scales,
    )

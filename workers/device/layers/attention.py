"""Paged attention over a flattened batch that mixes decodes and prefill chunks.

The batch is laid out decodes first (one query token each), then prefill chunks. K/V of
the step's tokens are first written into the block pool through `slot_mapping`; then
- decodes: every decode's context is gathered from the pool through its block table into
  one padded [D, KH, L, Dh] tensor and attended in a single SDPA call with a length mask;
- prefill chunks: per sequence, causal attention of the chunk's queries over its whole
  context (cached prefix + the chunk). A chunk with no cached prefix attends to its own
  fresh K/V directly (no gather).
This is the torch-native path that runs on CPU and CUDA; a fused CUDA kernel can replace
`PagedAttention.forward` behind the same metadata. On CPU in float32 the C kernel
(workers/device/layers/cpu_kernels/) reads K/V in place instead: for the decodes, a row each,
and for every prefill chunk, which the batch lays out right after the decodes (`meta.prefills` is
empty there): a chunk over a short context as rows of the decode kernel, a row per query
token; the others through the prefill kernel (csrc/paged_prefill_attention.c), where blocks
of query tokens share each K/V read.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from workers.device.layers import kv_quant
from workers.device.layers.cpu_kernels import (
    paged_decode_attention_cpu,
    paged_prefill_attention_cpu,
)


@dataclass
class PrefillSeq:
    q_start: int  # offset of the chunk in the flattened batch
    q_len: int
    context_len: int  # tokens attended to, chunk included
    context_slots: torch.Tensor | None  # [context_len] slot ids; None when context == chunk
    mask: torch.Tensor | None  # [q_len, context_len] bool, True = attend; None = plain causal


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] where each new token's K/V goes
    num_decodes: int
    decode_block_tables: torch.Tensor | None  # [D, max_blocks] ([R, ...] on the kernel path)
    decode_mask: torch.Tensor | None  # [D, 1, 1, L] bool (torch-native path)
    prefills: list[PrefillSeq]
    decode_lens: torch.Tensor | None = None  # [R] tokens attended (CPU kernel path)
    cpu_kernel: object | None = None  # the loaded CPU decode kernel, when it is used
    # CPU kernel path: the first R tokens of the batch -- the decodes, then the query tokens
    # of the prefill chunks -- attend through the kernel, a row each.
    num_kernel_rows: int = 0
    # Of those, the first rows (decodes, then chunks over a short context) attend a query
    # token at a time through the decode kernel; the rest, the prefill chunks listed in
    # `prefill_chunks` ([C, 3] int64: first row, length, position of the first token; None
    # when there are none), through the prefill kernel.
    num_row_kernel_rows: int = 0
    prefill_chunks: torch.Tensor | None = None
    # The triton backend (workers/device/attention_backend.py): the step's tables for its
    # kernels (workers/device/layers/triton_metadata.py); set, the fields above are unused.
    triton: object | None = None


class PagedAttention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.gqa = num_heads != num_kv_heads
        # Head dims the CPU prefill kernel takes; with others every kernel row goes through
        # the decode kernel.
        self.blockwise = head_dim % 16 == 0 and head_dim <= 256
        # An FP8 KV cache's scales (workers/device/layers/kv_quant.py): the checkpoint's
        # `self_attn.k_scale` / `v_scale` when it has them (the loader sets these).
        self.k_scale = 1.0
        self.v_scale = 1.0

    def forward(
        self,
        q: torch.Tensor,  # [T, H, Dh]
        k: torch.Tensor,  # [T, KH, Dh]
        v: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],  # 2 x [num_blocks, block_size, KH, Dh]
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        k_cache, v_cache = kv_cache
        if meta.triton is not None:
            # One launch for the K/V store and one for every row's attention, in place.
            from workers.device.layers import triton_attention as ta

            scales = (self.k_scale, self.v_scale)
            ta.store_kv(k, v, k_cache, v_cache, meta.slot_mapping, scales)
            return ta.paged_attention_step(q, k_cache, v_cache, meta.triton, self.scale, scales)
        nb, bs = k_cache.shape[:2]
        k_flat = k_cache.view(nb * bs, self.num_kv_heads, self.head_dim)
        v_flat = v_cache.view(nb * bs, self.num_kv_heads, self.head_dim)
        kv_quant.store(k_flat, meta.slot_mapping, k, self.k_scale)
        kv_quant.store(v_flat, meta.slot_mapping, v, self.v_scale)
        fp8 = kv_quant.is_fp8(k_cache)

        out = torch.empty_like(q)
        d = meta.num_decodes
        if meta.num_kernel_rows:
            r = meta.num_kernel_rows
            chunks = meta.prefill_chunks if self.blockwise else None
            rows = r if chunks is None else meta.num_row_kernel_rows
            if rows:
                out[:rows] = paged_decode_attention_cpu(
                    meta.cpu_kernel,
                    q[:rows],
                    k_cache,
                    v_cache,
                    meta.decode_block_tables[:rows],
                    meta.decode_lens[:rows],
                    self.scale,
                )
            if chunks is not None:
                paged_prefill_attention_cpu(
                    meta.cpu_kernel,
                    q[:r],
                    k_cache,
                    v_cache,
                    meta.decode_block_tables,
                    chunks,
                    out[:r],
                    self.scale,
                )
        elif d:
            tables = meta.decode_block_tables
            kd = kv_quant.read(k_cache[tables], self.k_scale, q.dtype)
            vd = kv_quant.read(v_cache[tables], self.v_scale, q.dtype)
            kd = kd.flatten(1, 2).transpose(1, 2)  # [D, KH, L, Dh]
            vd = vd.flatten(1, 2).transpose(1, 2)
            qd = q[:d].unsqueeze(2)  # [D, H, 1, Dh]
            o = F.scaled_dot_product_attention(
                qd, kd, vd, attn_mask=meta.decode_mask, scale=self.scale, enable_gqa=self.gqa
            )
            out[:d] = o.squeeze(2)
        for p in meta.prefills:
            sl = slice(p.q_start, p.q_start + p.q_len)
            qp = q[sl].transpose(0, 1)  # [H, q, Dh]
            if p.context_slots is None:
                kp, vp = k[sl], v[sl]
                if fp8:  # as the cache holds them (kv_quant.py)
                    kp = kv_quant.round_trip(kp, self.k_scale)
                    vp = kv_quant.round_trip(vp, self.v_scale)
                kp, vp = kp.transpose(0, 1), vp.transpose(0, 1)
            else:
                kp = kv_quant.read(k_flat[p.context_slots], self.k_scale, q.dtype)
                vp = kv_quant.read(v_flat[p.context_slots], self.v_scale, q.dtype)
                kp, vp = kp.transpose(0, 1), vp.transpose(0, 1)  # [KH, ctx, Dh]
            # 4-D (a batch of one): given 3-D tensors SDPA takes its math path, which
            # materialises the scores (11x slower for a 2,048-token chunk on CPU).
            o = F.scaled_dot_product_attention(
                qp[None],
                kp[None],
                vp[None],
                attn_mask=p.mask,
                is_causal=p.mask is None,
                scale=self.scale,
                enable_gqa=self.gqa,
            )
            out[sl] = o[0].transpose(0, 1)
        return out

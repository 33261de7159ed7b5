"""The mixture-of-experts MLP without a host sync, for the triton backend: the experts'
matmuls as one grouped-GEMM launch each (gate/up, then down), whose programs find their
expert's rows from device tensors, so the layer never asks the host how many tokens each
expert got (workers/device/layers/moe.py's torch path does, once per layer: a sync on CUDA
that also keeps MoE models out of CUDA graphs).

The arithmetic is the torch path's, step for step: (token, expert) pairs sorted by expert
(stable, so a token's pairs keep expert order), each expert's rows through its gate/up and
down projections (products in the weights' dtype, sums in float32, rounded to the model's
dtype like F.linear), SiLU(gate) * up and the routing weight in torch, and each token's
outputs added in expert order from zero, as transformers adds them.

Grid of a grouped GEMM: (expert, block of BLOCK_M rows, block of BLOCK_N columns). An expert
has at most T rows (a token picks an expert once), so cdiv(T, BLOCK_M) row blocks cover any
routing; a program past its expert's rows returns before loading a weight, so an expert no
token picked costs a few idle programs and reads nothing.

This module imports triton: import it only where the triton backend was chosen.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _grouped_linear_kernel(
    a_ptr,
    w_ptr,
    out_ptr,
    rows_ptr,  # [R] the row of `a` each sorted pair reads
    seg_ptr,  # [E + 1] each expert's first sorted pair
    N,
    K,
    stride_am,
    stride_we,
    stride_wn,
    stride_om,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    IEEE: tl.constexpr,  # float32: exact products (a GPU's float32 dot defaults to TF32)
):
    e = tl.program_id(0)
    start = tl.load(seg_ptr + e)
    end = tl.load(seg_ptr + e + 1)
    first = start + tl.program_id(1) * BLOCK_M
    if first < end:
        r = first + tl.arange(0, BLOCK_M)
        r_ok = r < end
        a_row = tl.load(rows_ptr + r, mask=r_ok, other=0).to(tl.int64)
        n = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = n < N
        w = w_ptr + e.to(tl.int64) * stride_we
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            k_ok = k < K
            a = tl.load(
                a_ptr + a_row[:, None] * stride_am + k[None, :],
                mask=r_ok[:, None] & k_ok[None, :],
                other=0.0,
            )
            b = tl.load(  # W[e] is [N, K]: this tile of its transpose
                w + n[None, :].to(tl.int64) * stride_wn + k[:, None],
                mask=k_ok[:, None] & n_ok[None, :],
                other=0.0,
            )
            if IEEE:
                acc += tl.dot(a, b, input_precision="ieee")
            else:
                acc += tl.dot(a, b)
        tl.store(
            out_ptr + r[:, None].to(tl.int64) * stride_om + n[None, :],
            acc.to(out_ptr.dtype.element_ty),
            mask=r_ok[:, None] & n_ok[None, :],
        )


def grouped_linear(
    a: torch.Tensor,  # [M, K]
    w: torch.Tensor,  # [E, N, K]
    rows: torch.Tensor,  # [R] int: the row of `a` each sorted pair reads
    seg: torch.Tensor,  # [E + 1] int: pairs seg[e] .. seg[e+1] go through expert e
    max_rows: int,  # the most pairs any expert can have (the grid's row blocks)
    out: torch.Tensor,  # [R, N], written where some expert has the pair
) -> torch.Tensor:
    """out[p] = a[rows[p]] @ w[e].T for each pair p of each expert e: one launch."""
    num_experts, n, k = w.shape
    if rows.numel() == 0 or num_experts == 0:
        return out
    assert a.stride(1) == 1 and w.stride(2) == 1 and out.stride(1) == 1
    block_m = 16
    block_n = min(64, max(16, triton.next_power_of_2(n)))
    block_k = min(64, max(16, triton.next_power_of_2(k)))
    grid = (num_experts, triton.cdiv(max_rows, block_m), triton.cdiv(n, block_n))
    _grouped_linear_kernel[grid](
        a,
        w,
        out,
        rows,
        seg,
        n,
        k,
        a.stride(0),
        w.stride(0),
        w.stride(1),
        out.stride(0),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        IEEE=a.dtype == torch.float32,
    )
    return out


def moe_experts(
    x: torch.Tensor,  # [T, H]
    weights: torch.Tensor,  # [T, k] routing weights
    ids: torch.Tensor,  # [T, k] expert ids (checkpoint numbering)
    w13: torch.Tensor,  # [E_local, 2I, H]
    w2: torch.Tensor,  # [E_local, H, I]
    first_expert: int,
) -> torch.Tensor:
    """This rank's share of sum_j weights[t, j] * expert_{ids[t, j]}(x[t]) (before the
    all-reduce), with no host sync: `SparseMoeBlock.experts`'s result, on device tensors."""
    t, k = ids.shape
    n_local, two_inter, _ = w13.shape
    inter = two_inter // 2
    flat = ids.reshape(-1) - first_expert
    # Pairs of experts held elsewhere (expert parallelism) sort last and are never run.
    flat = torch.where((flat >= 0) & (flat < n_local), flat, n_local)
    order = torch.argsort(flat, stable=True)
    # Pairs per expert with index_add_, not bincount: CUDA's bincount reads its largest input
    # back to the host, the very sync this path exists to avoid.
    counts = torch.zeros(n_local + 1, dtype=torch.int64, device=x.device)
    counts.index_add_(0, flat, torch.ones_like(flat))
    seg = torch.zeros(n_local + 1, dtype=torch.int64, device=x.device)
    torch.cumsum(counts[:n_local], 0, out=seg[1:])
    tokens = order // k
    gate_up = torch.empty((t * k, two_inter), dtype=x.dtype, device=x.device)
    grouped_linear(x, w13, tokens, seg, t, gate_up)
    gate, up = gate_up.split(inter, dim=-1)
    act = (torch.nn.functional.silu(gate) * up).contiguous()
    # Pairs no local expert runs keep zeros: they add nothing to their token's sum.
    y = torch.zeros((t * k, x.shape[1]), dtype=x.dtype, device=x.device)
    grouped_linear(act, w2, torch.arange(t * k, device=x.device), seg, t, y)
    w = weights.reshape(-1).index_select(0, order).unsqueeze(-1)
    y = (y * w).to(x.dtype)
    # Each token's k pairs together, in expert order (sorted by (token, expert)), then summed
    # from zero in that order.
    by_token = y.index_select(0, torch.argsort(tokens * (n_local + 1) + flat[order]))
    return _sum_in_order(by_token.view(t, k, -1))


def _sum_in_order(y: torch.Tensor) -> torch.Tensor:
    """sum_j y[:, j] from zero, left to right (a reduction kernel may add in another order)."""
    out = torch.zeros_like(y[:, 0])
    for j in range(y.shape[1]):
        out = out + y[:, j]
    return out

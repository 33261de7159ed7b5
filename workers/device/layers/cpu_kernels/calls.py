"""The kernels called through ctypes on given tensors: the bodies of the custom ops
(ops.py). Each takes the library, its inputs laid out as the C code reads them, and the output
it writes into; none allocates its result."""

from __future__ import annotations

import ctypes

import torch

from workers.device.layers.cpu_kernels.packing import amx_packed


def _threads() -> int:
    return max(1, torch.get_num_threads())


def decode_attention(
    lib: ctypes.CDLL,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    tables: torch.Tensor,
    lens: torch.Tensor,
    out: torch.Tensor,
    scale: float,
) -> None:
    """One query row per block-table row, into `out` (contiguous like `q`, which must be)."""
    d, h, dh = q.shape
    _, bs, kh, _ = k_cache.shape
    max_blocks = tables.shape[1]
    max_len = max_blocks * bs
    threads = _threads()
    scratch = torch.empty(threads * h * max_len, dtype=torch.float32)
    lib.paged_decode_attention(
        q.data_ptr(),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        tables.data_ptr(),
        lens.data_ptr(),
        out.data_ptr(),
        scratch.data_ptr(),
        d,
        h,
        kh,
        dh,
        bs,
        max_blocks,
        max_len,
        threads,
        scale,
    )


def prefill_attention(
    lib: ctypes.CDLL,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    tables: torch.Tensor,
    chunks: torch.Tensor,
    out: torch.Tensor,
    scale: float,
) -> None:
    _, h, dh = q.shape
    _, bs, kh, _ = k_cache.shape
    status = lib.paged_prefill_attention(
        q.data_ptr(),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        tables.data_ptr(),
        chunks.data_ptr(),
        out.data_ptr(),
        chunks.shape[0],
        h,
        kh,
        dh,
        bs,
        tables.shape[1],
        _threads(),
        scale,
    )
    if status != 0:
        raise RuntimeError(f"paged_prefill_attention failed (head_dim {dh}, or out of memory)")


def skinny(
    lib: ctypes.CDLL,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    out: torch.Tensor,
) -> None:
    m, k = x.shape
    lib.skinny_gemm(
        x.data_ptr(),
        weight.data_ptr(),
        None if bias is None else bias.data_ptr(),
        out.data_ptr(),
        m,
        k,
        out.shape[1],
    )


def bf16(
    lib: ctypes.CDLL,
    x: torch.Tensor,
    packed: torch.Tensor,
    bias: torch.Tensor | None,
    out: torch.Tensor,
) -> None:
    """x @ W.T (+ bias) with W given packed (`pack_bf16_weight`, either layout)."""
    m, k = x.shape
    gemm = lib.amx_linear if amx_packed(packed) else lib.bf16_linear
    status = gemm(
        x.data_ptr(),
        packed.data_ptr(),
        None if bias is None else bias.data_ptr(),
        out.data_ptr(),
        m,
        k,
        out.shape[1],
        _threads(),
    )
    check_gemm(status)


def check_gemm(status: int) -> None:
    """Raises for a failed bfloat16-weight GEMM call (bf16_linear.c or amx_linear.c)."""
    if status == -1:
        raise MemoryError("bfloat16-weight GEMM: no memory for its copy of x")
    if status != 0:  # -2: amx_linear called on a build without AMX (use_cpu_kernels asks first)
        raise RuntimeError(f"bfloat16-weight GEMM failed with status {status}")


def rms_norm(
    lib: ctypes.CDLL, x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, eps: float
) -> None:
    """RMSNorm over the last dimension into `out` (contiguous, x's shape). A 3-D view with a
    dense last dimension (the q/k heads) is read in place; anything else made contiguous."""
    if x.dim() == 3 and x.stride(-1) == 1:
        x3 = x
    else:
        x3 = x.contiguous().view(-1, 1, x.shape[-1])
    outer, inner, dim = x3.shape
    lib.rms_norm(
        x3.data_ptr(),
        weight.data_ptr(),
        out.data_ptr(),
        outer,
        inner,
        x3.stride(0),
        x3.stride(1),
        dim,
        eps,
    )


def rotary(
    lib: ctypes.CDLL,
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
) -> None:
    """Rotates q [T, H, D] and k [T, KH, D] in place (last dim dense; positions int64)."""
    lib.rotary(
        q.data_ptr(),
        q.shape[1],
        q.stride(0),
        q.stride(1),
        k.data_ptr(),
        k.shape[1],
        k.stride(0),
        k.stride(1),
        q.shape[0],
        q.shape[2],
        cos.data_ptr(),
        sin.data_ptr(),
        positions.data_ptr(),
    )


def silu_and_mul(lib: ctypes.CDLL, gate_up: torch.Tensor, out: torch.Tensor) -> None:
    t, two_i = gate_up.shape
    lib.silu_and_mul(gate_up.data_ptr(), out.data_ptr(), t, two_i // 2)

"""The decoder layer's elementwise pieces in Triton, one launch each, for the triton backend.

On a GPU a decode step is bound by the host dispatching ops: RMSNorm alone is seven torch
ops, rotary a dozen. With the triton backend (workers/device/attention_backend.py) the worker
calls `use_triton_layers`, and the modules (norm.py, rotary.py, the models' MLPs and layers)
run these instead:

- `rms_norm`: RMSNorm of rows of D (a [T, D] hidden state, or [T, heads, D] q/k heads), with
  the residual add folded in when given (`x += residual` in place, then the norm of the sum),
  the output written where asked (the layers reuse the residual's buffer, or normalise q/k in
  place);
- `rotary_`: q and k rotated in place (rotate-half layout, cos/sin rows by position);
- `act_and_mul`: SiLU (or Gemma's tanh GELU) of the gate times up, over a fused [T, 2I].

Arithmetic: float32, each step rounded to the tensors' dtype where the torch modules round,
so the results equal theirs up to float rounding: the residual sums and rotary bit for bit
(products of two bfloat16/float16 values are exact in float32), the norms up to the order of
the sum of squares, the activations up to exp's last bit. Triton's interpreter (CPU tests)
truncates when it narrows to bfloat16 where a GPU rounds to nearest.

This module imports triton: import it only where the triton backend was chosen (Triton reads
TRITON_INTERPRET when a kernel is defined).
"""

from __future__ import annotations

import sys

import torch
import triton
import triton.language as tl

# Elements per program of `act_and_mul` (a power of two).
ACT_BLOCK = 1024


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    eps,
    stride_xt,
    stride_xh,
    stride_rt,
    stride_rh,
    stride_ot,
    stride_oh,
    HEADS: tl.constexpr,  # rows of D per token (1 for a hidden state)
    HEADS_P: tl.constexpr,
    D: tl.constexpr,
    D_P: tl.constexpr,
    HAS_RES: tl.constexpr,  # x += res first (x written back)
    CAST_FIRST: tl.constexpr,  # RMSNorm: w * h.to(dtype); Gemma's: (h * w).to(dtype)
):
    t = tl.program_id(0).to(tl.int64)
    h = tl.arange(0, HEADS_P)
    d = tl.arange(0, D_P)
    m = (h < HEADS)[:, None] & (d < D)[None, :]
    x_at = x_ptr + t * stride_xt + h[:, None] * stride_xh + d[None, :]
    x = tl.load(x_at, mask=m, other=0.0).to(tl.float32)
    if HAS_RES:
        r_at = res_ptr + t * stride_rt + h[:, None] * stride_rh + d[None, :]
        # Rounded to the residual stream's dtype, as torch's add rounds it.
        s = (x + tl.load(r_at, mask=m, other=0.0).to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(x_at, s, mask=m)
        x = s.to(tl.float32)
    var = tl.sum(x * x, axis=1) / D
    y = x * tl.rsqrt(var + eps)[:, None]
    w = tl.load(w_ptr + d, mask=d < D, other=0.0).to(tl.float32)[None, :]
    if CAST_FIRST:
        y = y.to(out_ptr.dtype.element_ty).to(tl.float32) * w
    else:
        y = y * w
    out_at = out_ptr + t * stride_ot + h[:, None] * stride_oh + d[None, :]
    tl.store(out_at, y.to(out_ptr.dtype.element_ty), mask=m)


def _row_strides(x: torch.Tensor) -> tuple[int, int]:
    return x.stride(0), (x.stride(1) if x.dim() == 3 else 0)


def rms_norm(
    x: torch.Tensor,  # [T, D] or [T, heads, D], the last dim contiguous
    weight: torch.Tensor,  # [D]
    eps: float,
    residual: torch.Tensor | None = None,  # like x: x += residual first, in place
    out: torch.Tensor | None = None,  # like x (may be x itself or `residual`); None: new
    cast_first: bool = True,
) -> torch.Tensor:
    """norm(x) * weight per row of D in float32, in x's dtype: one launch. `cast_first`:
    RMSNorm's order (the normalised row cast to x's dtype, then times the weight, rounded);
    False: Gemma's (times the float32 weight, then cast)."""
    if out is None:
        out = torch.empty_like(x)
    if x.shape[0] == 0 or x.numel() == 0:
        return out
    assert x.dim() in (2, 3) and x.stride(-1) == 1 and out.stride(-1) == 1
    heads, d = (x.shape[1] if x.dim() == 3 else 1), x.shape[-1]
    res = x if residual is None else residual
    assert res.shape == x.shape and res.stride(-1) == 1
    _rms_norm_kernel[(x.shape[0],)](
        x,
        res,
        weight,
        out,
        eps,
        *_row_strides(x),
        *_row_strides(res),
        *_row_strides(out),
        HEADS=heads,
        HEADS_P=triton.next_power_of_2(heads),
        D=d,
        D_P=triton.next_power_of_2(d),
        HAS_RES=residual is not None,
        CAST_FIRST=cast_first,
    )
    return out


@triton.jit
def _rotate(base, h, d, heads, stride_h, c1, c2, s1, s2, HALF: tl.constexpr):
    """Rotates one token's heads (rows of 2 * HALF at `base`) in place."""
    m = (h < heads)[:, None] & (d < HALF)[None, :]
    at = base + h[:, None] * stride_h + d[None, :]
    x1 = tl.load(at, mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(at + HALF, mask=m, other=0.0).to(tl.float32)
    dt = base.dtype.element_ty
    # x * cos + cat(-x2, x1) * sin, each product rounded to the dtype as torch's ops round it.
    o1 = (x1 * c1).to(dt).to(tl.float32) + (-x2 * s1).to(dt).to(tl.float32)
    o2 = (x2 * c2).to(dt).to(tl.float32) + (x1 * s2).to(dt).to(tl.float32)
    tl.store(at, o1.to(dt), mask=m)
    tl.store(at + HALF, o2.to(dt), mask=m)


@triton.jit
def _rotary_kernel(
    q_ptr,
    k_ptr,
    pos_ptr,
    cos_ptr,
    sin_ptr,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_cos,
    Q_HEADS: tl.constexpr,
    Q_HEADS_P: tl.constexpr,
    K_HEADS: tl.constexpr,
    K_HEADS_P: tl.constexpr,
    HALF: tl.constexpr,  # head_dim // 2
    HALF_P: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, HALF_P)
    dm = d < HALF
    row = tl.load(pos_ptr + t).to(tl.int64) * stride_cos
    c1 = tl.load(cos_ptr + row + d, mask=dm, other=0.0).to(tl.float32)[None, :]
    c2 = tl.load(cos_ptr + row + HALF + d, mask=dm, other=0.0).to(tl.float32)[None, :]
    s1 = tl.load(sin_ptr + row + d, mask=dm, other=0.0).to(tl.float32)[None, :]
    s2 = tl.load(sin_ptr + row + HALF + d, mask=dm, other=0.0).to(tl.float32)[None, :]
    hq = tl.arange(0, Q_HEADS_P)
    _rotate(q_ptr + t * stride_qt, hq, d, Q_HEADS, stride_qh, c1, c2, s1, s2, HALF)
    hk = tl.arange(0, K_HEADS_P)
    _rotate(k_ptr + t * stride_kt, hk, d, K_HEADS, stride_kh, c1, c2, s1, s2, HALF)


def rotary_(
    positions: torch.Tensor,  # [T] int
    q: torch.Tensor,  # [T, H, D], the last dim contiguous
    k: torch.Tensor,  # [T, KH, D]
    cos: torch.Tensor,  # [max_pos, D], q's dtype
    sin: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotates q and k in place (rotate-half layout): one launch for both. Returns them."""
    t = q.shape[0]
    if t == 0:
        return q, k
    assert q.stride(2) == 1 and k.stride(2) == 1 and cos.stride(1) == 1 and sin.stride(1) == 1
    assert cos.stride(0) == sin.stride(0) and q.shape[2] % 2 == 0
    half = q.shape[2] // 2
    _rotary_kernel[(t,)](
        q,
        k,
        positions,
        cos,
        sin,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        cos.stride(0),
        Q_HEADS=q.shape[1],
        Q_HEADS_P=triton.next_power_of_2(q.shape[1]),
        K_HEADS=k.shape[1],
        K_HEADS_P=triton.next_power_of_2(k.shape[1]),
        HALF=half,
        HALF_P=triton.next_power_of_2(half),
    )
    return q, k


@triton.jit
def _act_and_mul_kernel(
    gu_ptr,
    out_ptr,
    stride_gt,
    stride_ot,
    INTER: tl.constexpr,
    BLOCK: tl.constexpr,
    GELU: tl.constexpr,  # gelu (tanh approximation) instead of SiLU
):
    t = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = j < INTER
    g = tl.load(gu_ptr + t * stride_gt + j, mask=m, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + t * stride_gt + INTER + j, mask=m, other=0.0).to(tl.float32)
    if GELU:
        inner = 0.7978845608028654 * (g + 0.044715 * g * g * g)  # sqrt(2 / pi) * (...)
        # 0.5 * (1 + tanh(y)) is sigmoid(2y): no cancellation where tanh nears -1.
        a = g / (1.0 + tl.exp(-2.0 * inner))
    else:
        a = g / (1.0 + tl.exp(-g))
    dt = out_ptr.dtype.element_ty
    # act(gate) rounded to the dtype, then times up: torch's two ops.
    tl.store(out_ptr + t * stride_ot + j, (a.to(dt).to(tl.float32) * u).to(dt), mask=m)


def act_and_mul(gate_up: torch.Tensor, gelu: bool = False) -> torch.Tensor:
    """[T, 2I] (gate, then up) -> act(gate) * up, [T, I]: one launch. act: SiLU, or with
    `gelu` gelu's tanh approximation (Gemma's GeGLU)."""
    t, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty((t, inter), dtype=gate_up.dtype, device=gate_up.device)
    if t == 0 or inter == 0:
        return out
    assert gate_up.stride(1) == 1
    block = min(ACT_BLOCK, triton.next_power_of_2(inter))
    _act_and_mul_kernel[(t, triton.cdiv(inter, block))](
        gate_up, out, gate_up.stride(0), out.stride(0), INTER=inter, BLOCK=block, GELU=gelu
    )
    return out


def use_triton_layers(model: torch.nn.Module) -> int:
    """Route a model's norms, rotary, MLP activations and layers through these kernels: every
    module with a `triton_layers` slot gets this module. Returns how many modules took it."""
    this = sys.modules[__name__]
    n = 0
    for module in model.modules():
        if hasattr(module, "triton_layers"):
            module.triton_layers = this
            n += 1
    return n

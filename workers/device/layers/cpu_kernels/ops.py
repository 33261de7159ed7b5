"""The kernels as torch custom ops (`torch.ops.kvray.*`), so that torch.compile traces
through them: each has a fake implementation giving its output's shape and dtype, and the
ops that write into their arguments declare them mutated.

An op names its library by an int handle (`register`): the engine's build for this CPU, or
another one in tests (the AVX2 build on an AVX-512 host). The functions below take either a
loaded library or a handle, lay out their inputs as the C code reads them and call the op.
"""

import ctypes

import torch
from torch.library import custom_op, register_fake

from . import calls
from .routing import kernel_route

_LIBS: list[ctypes.CDLL] = []
_HANDLES: dict[int, int] = {}  # id(library) -> handle (the libraries are kept alive)


def register(lib: ctypes.CDLL | int) -> int:
    """The handle the ops know `lib` by (registered on first use)."""
    if isinstance(lib, int):
        return lib
    handle = _HANDLES.get(id(lib))
    if handle is None:
        handle = _HANDLES[id(lib)] = len(_LIBS)
        _LIBS.append(lib)
    return handle


def library(handle: int) -> ctypes.CDLL:
    """The library registered as `handle`."""
    return _LIBS[handle]


# -- the ops --------------------------------------------------------------------------------


@custom_op(
    "kvray::rms_norm",
    mutates_args=(),
    schema="(Tensor x, Tensor weight, float eps, int lib) -> Tensor",
)
def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, lib: int) -> torch.Tensor:
    out = torch.empty(x.shape, dtype=x.dtype)
    calls.rms_norm(_LIBS[lib], x, weight, out, eps)
    return out


@register_fake("kvray::rms_norm")
def _(x, weight, eps, lib):  # noqa: ANN001, ANN202
    return x.new_empty(x.shape)


@custom_op(
    "kvray::rotary_",
    mutates_args=("q", "k"),
    schema="(Tensor(a!) q, Tensor(b!) k, Tensor positions, Tensor cos, Tensor sin, int lib) -> ()",
)
def _rotary(q, k, positions, cos, sin, lib):  # noqa: ANN001, ANN202
    dense_q, dense_k = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k))
    calls.rotary(_LIBS[lib], positions.to(torch.int64).contiguous(), dense_q, dense_k, cos, sin)
    for t, dense in ((q, dense_q), (k, dense_k)):
        if dense is not t:
            t.copy_(dense)


@register_fake("kvray::rotary_")
def _(q, k, positions, cos, sin, lib):  # noqa: ANN001, ANN202
    return None


@custom_op("kvray::silu_and_mul", mutates_args=(), schema="(Tensor gate_up, int lib) -> Tensor")
def _silu_and_mul(gate_up, lib):  # noqa: ANN001, ANN202
    gate_up = gate_up.contiguous()
    out = gate_up.new_empty(gate_up.shape[0], gate_up.shape[1] // 2)
    calls.silu_and_mul(_LIBS[lib], gate_up, out)
    return out


@register_fake("kvray::silu_and_mul")
def _(gate_up, lib):  # noqa: ANN001, ANN202
    return gate_up.new_empty(gate_up.shape[0], gate_up.shape[1] // 2)


@custom_op(
    "kvray::linear",
    mutates_args=(),
    schema="(Tensor x, Tensor? weight, Tensor? packed, Tensor? bias, int out_features, int lib)"
    " -> Tensor",
)
def _linear(x, weight, packed, bias, out_features, lib):  # noqa: ANN001, ANN202
    """A 2-D x's linear layer, through the GEMM `kernel_route` picks for its row count (known
    only here when compiled); `weight` None: freed, the packed copy serves every step."""
    route = kernel_route(x.shape[0], weight, packed)
    if route is None:
        return torch.nn.functional.linear(x, weight, bias)
    x = x.contiguous()
    out = x.new_empty(x.shape[0], out_features)
    if route == "bf16":
        calls.bf16(_LIBS[lib], x, packed, bias, out)
    else:
        calls.skinny(_LIBS[lib], x, weight, bias, out)
    return out


@register_fake("kvray::linear")
def _(x, weight, packed, bias, out_features, lib):  # noqa: ANN001, ANN202
    return x.new_empty(x.shape[0], out_features)


@custom_op(
    "kvray::skinny_linear_out",
    mutates_args=("out",),
    schema="(Tensor x, Tensor weight, Tensor? bias, Tensor(a!) out, int lib) -> ()",
)
def _skinny_out(x, weight, bias, out, lib):  # noqa: ANN001, ANN202
    calls.skinny(_LIBS[lib], x.contiguous(), weight, bias, out)


@register_fake("kvray::skinny_linear_out")
def _(x, weight, bias, out, lib):  # noqa: ANN001, ANN202
    return None


@custom_op(
    "kvray::bf16_linear_out",
    mutates_args=("out",),
    schema="(Tensor x, Tensor packed, Tensor? bias, Tensor(a!) out, int lib) -> ()",
)
def _bf16_out(x, packed, bias, out, lib):  # noqa: ANN001, ANN202
    calls.bf16(_LIBS[lib], x.contiguous(), packed, bias, out)


@register_fake("kvray::bf16_linear_out")
def _(x, packed, bias, out, lib):  # noqa: ANN001, ANN202
    return None


@custom_op(
    "kvray::paged_decode_attention",
    mutates_args=(),
    schema="(Tensor q, Tensor k_cache, Tensor v_cache, Tensor tables, Tensor lens, float scale,"
    " int lib) -> Tensor",
)
def _decode(q, k_cache, v_cache, tables, lens, scale, lib):  # noqa: ANN001, ANN202
    q = q.contiguous()
    out = torch.empty_like(q)
    calls.decode_attention(_LIBS[lib], q, k_cache, v_cache, tables, lens, out, scale)
    return out


@register_fake("kvray::paged_decode_attention")
def _(q, k_cache, v_cache, tables, lens, scale, lib):  # noqa: ANN001, ANN202
    return q.new_empty(q.shape)


@custom_op(
    "kvray::paged_prefill_attention",
    mutates_args=("out",),
    schema="(Tensor q, Tensor k_cache, Tensor v_cache, Tensor tables, Tensor chunks,"
    " Tensor(a!) out, float scale, int lib) -> ()",
)
def _prefill(q, k_cache, v_cache, tables, chunks, out, scale, lib):  # noqa: ANN001, ANN202
    calls.prefill_attention(
        _LIBS[lib], q.contiguous(), k_cache, v_cache, tables, chunks, out, scale
    )


@register_fake("kvray::paged_prefill_attention")
def _(q, k_cache, v_cache, tables, chunks, out, scale, lib):  # noqa: ANN001, ANN202
    return None


# -- the functions the layers call ------------------------------------------------------------


def rms_norm_cpu(lib, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:  # noqa: ANN001
    """RMSNorm over the last dimension of a float32 `x` (a 3-D view with a dense last
    dimension, like the q/k heads, is read in place; anything else is made contiguous)."""
    return torch.ops.kvray.rms_norm(x, weight, eps, register(lib))


def rotary_cpu(lib, positions, q, k, cos, sin) -> tuple[torch.Tensor, torch.Tensor]:  # noqa: ANN001
    """Rotates q [T, H, D] and k [T, KH, D] in place (a copy first where the last dim is not
    dense) and returns them."""
    if q.stride(-1) != 1:
        q = q.contiguous()
    if k.stride(-1) != 1:
        k = k.contiguous()
    torch.ops.kvray.rotary_(q, k, positions, cos, sin, register(lib))
    return q, k


def silu_and_mul_cpu(lib, gate_up: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
    """silu(gate) * up of a 2-D float32 [T, 2 * I] fused projection (gate first)."""
    return torch.ops.kvray.silu_and_mul(gate_up, register(lib))


def kernel_linear(
    lib,  # noqa: ANN001
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    packed_weight: torch.Tensor | None,
) -> torch.Tensor:
    """`nn.functional.linear` of a 2-D `x` through `kernel_route`'s GEMM for its rows."""
    w = None if weight.is_meta else weight
    return torch.ops.kvray.linear(x, w, packed_weight, bias, weight.shape[0], register(lib))


def _linear_out(x: torch.Tensor, n: int, out: torch.Tensor | None) -> torch.Tensor:
    """`out` checked to be a contiguous float32 [rows of x, n] to write into, or a new one."""
    if out is None:
        return torch.empty(x.shape[0], n, dtype=x.dtype)
    if out.shape != (x.shape[0], n) or out.dtype != x.dtype or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous {x.dtype} [{x.shape[0]}, {n}]")
    return out


def skinny_linear(lib, x, weight, bias, out=None) -> torch.Tensor:  # noqa: ANN001
    """`nn.functional.linear(x, weight, bias)` for a 2-D float32 `x` of a few rows (into
    `out` when given)."""
    out = _linear_out(x, weight.shape[0], out)
    torch.ops.kvray.skinny_linear_out(x, weight, bias, out, register(lib))
    return out


def bf16_linear(lib, x, packed, out_features: int, bias, out=None) -> torch.Tensor:  # noqa: ANN001
    """`nn.functional.linear(x, weight, bias)` for a 2-D float32 `x`, with `weight` given by
    `packed = pack_bf16_weight(weight)` (either layout), into `out` when given."""
    out = _linear_out(x, out_features, out)
    torch.ops.kvray.bf16_linear_out(x, packed, bias, out, register(lib))
    return out


def paged_decode_attention_cpu(lib, q, k_cache, v_cache, tables, lens, scale) -> torch.Tensor:  # noqa: ANN001
    """Each row of q [R, H, Dh] attends to its sequence's first `lens[r]` tokens, read in
    place from the block pool through `tables[r]`."""
    return torch.ops.kvray.paged_decode_attention(
        q, k_cache, v_cache, tables, lens, scale, register(lib)
    )


def paged_prefill_attention_cpu(lib, q, k_cache, v_cache, tables, chunks, out, scale) -> None:  # noqa: ANN001
    """Causal attention of prefill chunks into `out` (contiguous [R, H, Dh], like q):
    chunk c is rows [row0, row0 + n) of q, its first token at position pos0
    (`chunks[c] = (row0, n, pos0)`), reading its sequence's K/V through `tables[row0]`."""
    torch.ops.kvray.paged_prefill_attention(
        q, k_cache, v_cache, tables, chunks, out, scale, register(lib)
    )

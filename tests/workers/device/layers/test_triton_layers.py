"""The triton backend's norm, rotary and activation kernels, on CPU under Triton's interpreter,
against the torch modules they replace (norm.py, rotary.py, the models' MLP activations):
odd sizes, 0 and 1 rows, strided q/k views of a fused projection; float32 to 1e-6, float16
and bfloat16 (which the interpreter narrows by truncation, a GPU by rounding) to a few of
their ulps."""

from __future__ import annotations

from collections.abc import Iterator
from types import ModuleType

import pytest
import torch
from torch.nn import functional as F

from tests.triton_interpret import interpreted_kernels
from workers.config import RopeConfig
from workers.device.layers.norm import GemmaRMSNorm, RMSNorm
from workers.device.layers.rotary import RotaryEmbedding

MODULE = "workers.device.layers.triton_layers"
# (atol, rtol) per dtype: float32 as good as torch's own rounding; the half types a few ulps
# (bfloat16 has 8 bits of mantissa: 2**-8 relative is one ulp).
TOL = {torch.float32: (1e-6, 1e-6), torch.float16: (2e-3, 2e-3), torch.bfloat16: (2e-2, 2e-2)}
DTYPES = [pytest.param(d, id=str(d).removeprefix("torch.")) for d in TOL]


@pytest.fixture(scope="module")
def tk() -> Iterator[ModuleType]:
    """The kernel module with its kernels interpreted (defined after TRITON_INTERPRET=1)."""
    yield from interpreted_kernels(MODULE, "_rms_norm_kernel")


def _close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    atol, rtol = TOL[dtype]
    assert got.dtype == want.dtype and got.shape == want.shape
    torch.testing.assert_close(got.float(), want.float(), atol=atol, rtol=rtol)


def _norm(cls: type[RMSNorm], dim: int, dtype: torch.dtype, seed: int) -> RMSNorm:
    g = torch.Generator().manual_seed(seed)
    norm = cls(dim, 1e-6, dtype)
    norm.weight.data = (1 + 0.2 * torch.randn(dim, generator=g)).to(norm.weight.dtype)
    return norm


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [0, 1, 5])
@pytest.mark.parametrize("cls", [RMSNorm, GemmaRMSNorm])
def test_add_rms_norm_matches_the_module(
    tk: ModuleType, cls: type[RMSNorm], rows: int, dtype: torch.dtype
) -> None:
    """Hidden 80 (not a power of two): x += delta exactly as torch adds, the norm of the sum
    as the module computes it, written into delta's buffer as the layers ask."""
    norm = _norm(cls, 80, dtype, rows)
    g = torch.Generator().manual_seed(7)
    x = (3 * torch.randn(rows, 80, generator=g)).to(dtype)
    delta = torch.randn(rows, 80, generator=g).to(dtype)
    want_x = x + delta
    want = norm(want_x)
    got = tk.rms_norm(
        x, norm.weight, norm.eps, residual=delta, out=delta, cast_first=cls is RMSNorm
    )
    assert got.data_ptr() == delta.data_ptr()
    if dtype != torch.bfloat16:  # the residual stream bit for bit (bfloat16: see TOL)
        assert torch.equal(x, want_x)
    _close(x, want_x, dtype)
    _close(got, want, dtype)
    # Without the add: a new tensor, x untouched.
    before = x.clone()
    _close(tk.rms_norm(x, norm.weight, norm.eps, cast_first=cls is RMSNorm), norm(x), dtype)
    assert torch.equal(x, before)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128])
def test_qk_norm_in_place_on_strided_heads(
    tk: ModuleType, head_dim: int, dtype: torch.dtype
) -> None:
    """q and k as the layer has them, [T, heads, D] views of the fused qkv rows: normalised in
    place, v's columns untouched."""
    h, kh, t = 3, 1, 3
    qkv = torch.randn(t, (h + 2 * kh) * head_dim, generator=torch.Generator().manual_seed(1))
    qkv = qkv.to(dtype)
    q, k, v = qkv.view(t, h + 2 * kh, head_dim).split([h, kh, kh], dim=1)
    v_before = v.clone()
    q_norm, k_norm = _norm(RMSNorm, head_dim, dtype, 2), _norm(RMSNorm, head_dim, dtype, 3)
    want_q, want_k = q_norm(q), k_norm(k)
    tk.rms_norm(q, q_norm.weight, q_norm.eps, out=q)
    tk.rms_norm(k, k_norm.weight, k_norm.eps, out=k)
    _close(q, want_q, dtype)
    _close(k, want_k, dtype)
    assert torch.equal(v, v_before)


def _rotary(head_dim: int, dtype: torch.dtype) -> RotaryEmbedding:
    rope = RopeConfig(
        theta=10000.0,
        rope_type="llama3",
        factor=8.0,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position_embeddings=16,
    )
    return RotaryEmbedding(rope, head_dim, 64, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("rows", "head_dim"), [(0, 64), (1, 128), (4, 64), (3, 48)])
def test_rotary_in_place_matches_the_module(
    tk: ModuleType, rows: int, head_dim: int, dtype: torch.dtype
) -> None:
    """GQA heads (5 query heads over 2 KV heads, not powers of two), strided views of qkv,
    positions out of order."""
    h, kh = 5, 2
    rotary = _rotary(head_dim, dtype)
    g = torch.Generator().manual_seed(rows)
    qkv = torch.randn(rows, (h + 2 * kh) * head_dim, generator=g).to(dtype)
    q, k, _ = qkv.view(rows, h + 2 * kh, head_dim).split([h, kh, kh], dim=1)
    positions = torch.randperm(64, generator=g)[:rows]
    want_q, want_k = rotary(positions, q, k)
    got_q, got_k = tk.rotary_(positions, q, k, rotary.cos, rotary.sin)
    assert got_q.data_ptr() == q.data_ptr() and got_k.data_ptr() == k.data_ptr()
    if dtype == torch.float32:  # each product rounded as torch rounds it: bit for bit
        assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)
    _close(got_q, want_q, dtype)
    _close(got_k, want_k, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("rows", "inter"), [(0, 96), (1, 96), (3, 1500)])
@pytest.mark.parametrize("gelu", [False, True])
def test_act_and_mul_matches_torch(
    tk: ModuleType, rows: int, inter: int, gelu: bool, dtype: torch.dtype
) -> None:
    """SiLU (Llama's MLP) and tanh-GELU (Gemma's GeGLU) of the gate times up; 1500 spans two
    programs with a ragged end. Gate values reach +-12, where the activations saturate."""
    g = torch.Generator().manual_seed(inter)
    gate_up = (4 * torch.randn(rows, 2 * inter, generator=g)).to(dtype)
    gate, up = gate_up.split(inter, dim=-1)
    act = F.gelu(gate, approximate="tanh") if gelu else F.silu(gate)
    got = tk.act_and_mul(gate_up, gelu=gelu)
    if gelu and dtype == torch.float32:
        # torch's 0.5 * x * (1 + tanh(y)) loses bits where tanh nears -1 (the kernel takes
        # x * sigmoid(2y), the same function): both against float64, the kernel to 1e-6.
        g64, u64 = gate.double(), up.double()
        exact = F.gelu(g64, approximate="tanh") * u64
        torch.testing.assert_close(got.double(), exact, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(got, act * up, atol=2e-5, rtol=1e-5)
        return
    _close(got, act * up, dtype)

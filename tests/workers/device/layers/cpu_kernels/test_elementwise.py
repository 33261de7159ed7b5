"""The one-pass kernels (`kvray::rms_norm`, `kvray::rotary_`, `kvray::silu_and_mul`) through
the modules that call them, against those modules' torch paths."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from workers.config import RopeConfig
from workers.device.layers.cpu_kernels import register, silu_and_mul_cpu
from workers.device.layers.norm import RMSNorm
from workers.device.layers.rotary import RotaryEmbedding


@pytest.mark.parametrize("rows", [1, 5, 300])  # 300 x 256: the threaded branch
def test_rms_norm_matches_the_torch_path(lib, rows):
    gen = torch.Generator().manual_seed(rows)
    norm = RMSNorm(256, 1e-6, torch.float32)
    norm.weight.copy_(torch.randn(256, generator=gen))
    x = torch.randn(rows, 256, generator=gen) * 4
    expected = norm(x)
    norm.cpu_kernels = register(lib)
    torch.testing.assert_close(norm(x), expected, atol=1e-5, rtol=1e-5)


def test_rms_norm_of_heads_viewed_out_of_a_fused_projection(lib):
    # q = qkv[:, :q_size].view(T, H, Dh): rows of Dh are dense, heads and tokens strided.
    qkv = torch.randn(6, 4 * 64 + 2 * 2 * 64)
    q = qkv[:, : 4 * 64].view(6, 4, 64)
    norm = RMSNorm(64, 1e-6, torch.float32)
    norm.weight.copy_(torch.rand(64) + 0.5)
    expected = norm(q)
    norm.cpu_kernels = register(lib)
    out = norm(q)
    assert out.is_contiguous()
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("rows", [1, 7, 300])  # 300 x 256: the threaded branch
def test_add_rms_norm_is_the_add_then_the_norm_bit_for_bit(lib, rows):
    # The residual step of CpuLayers.run: x += delta in place, then the norm of the new x.
    gen = torch.Generator().manual_seed(rows)
    x, delta = torch.randn(rows, 256, generator=gen) * 4, torch.randn(rows, 256, generator=gen)
    weight = torch.randn(256, generator=gen)
    expected_x = x + delta
    expected = torch.empty(rows, 256)
    lib.rms_norm(
        expected_x.data_ptr(), weight.data_ptr(), expected.data_ptr(), rows, 1, 256, 256, 256, 1e-6
    )
    out = torch.full((rows, 256), float("nan"))
    lib.add_rms_norm(
        x.data_ptr(), delta.data_ptr(), weight.data_ptr(), out.data_ptr(), rows, 256, 1e-6
    )
    assert torch.equal(x, expected_x)
    assert torch.equal(out, expected)
    norm = RMSNorm(256, 1e-6, torch.float32)
    norm.weight.copy_(weight)
    torch.testing.assert_close(out, norm(expected_x), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("fused", [False, True])
def test_rotary_matches_the_torch_path(lib, fused):
    rope = RotaryEmbedding(RopeConfig(), 64, 512, torch.float32)
    positions = torch.tensor([0, 1, 7, 300, 511, 42], dtype=torch.int64)
    if fused:  # llama without q/k norms: q and k are views into the qkv projection
        qkv = torch.randn(6, 4 * 64 + 2 * 2 * 64)
        q, k = qkv[:, :256].view(6, 4, 64), qkv[:, 256:384].view(6, 2, 64)
    else:
        q, k = torch.randn(6, 4, 64), torch.randn(6, 2, 64)
    eq, ek = rope(positions, q, k)
    rope.cpu_kernels = register(lib)
    oq, ok = rope(positions, q.clone(), k.clone())
    torch.testing.assert_close(oq, eq, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ok, ek, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("rows", [1, 9, 200])  # 200 x 768: the threaded branch
def test_silu_and_mul_matches_torch(lib, rows):
    gate_up = torch.randn(rows, 2 * 384) * 4
    gate, up = gate_up.split(384, dim=-1)
    torch.testing.assert_close(
        silu_and_mul_cpu(lib, gate_up), F.silu(gate) * up, atol=1e-5, rtol=1e-5
    )


@pytest.mark.parametrize("shape", [(256,), (2, 3, 256), (2, 3, 4, 256)])
def test_rms_norm_of_other_ranks(lib, shape):
    norm = RMSNorm(256, 1e-6, torch.float32)
    x = torch.randn(*shape)
    expected = norm(x)
    norm.cpu_kernels = register(lib)
    out = norm(x)
    assert out.shape == x.shape
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_rotary_takes_int32_positions(lib):
    rope = RotaryEmbedding(RopeConfig(), 64, 512, torch.float32)
    q, k = torch.randn(3, 4, 64), torch.randn(3, 2, 64)
    positions = torch.tensor([5, 400, 9])
    eq, ek = rope(positions, q, k)
    rope.cpu_kernels = register(lib)
    oq, ok = rope(positions.to(torch.int32), q.clone(), k.clone())
    torch.testing.assert_close(oq, eq, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ok, ek, atol=1e-5, rtol=1e-5)

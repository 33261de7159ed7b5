"""csrc/amx_linear.c: bfloat16 weights on the AMX tiles, with x cut into three bfloat16 pieces,
against torch's float32 linear and a float64 reference; its packing, and the routing that
picks it. Skipped on CPUs (or kernels) without AMX, except what holds everywhere."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from tests.workers.kernel_builds import avx2_build
from workers.device.layers.cpu_kernels import (
    amx,
    amx_packed,
    bf16_linear,
    kernel,
    on_amx_tiles,
    pack_bf16_weight,
    use_cpu_kernels,
)


@pytest.fixture(scope="module")
def amx_lib():
    lib = kernel()
    if lib is None:
        pytest.skip("no C compiler: the engine uses the torch path")
    if not amx(lib):
        pytest.skip("no AMX here (CPU, compiler or kernel): the engine keeps bf16_linear.c")
    return lib


def _case(rows: int, k: int, n: int, bias: bool):
    gen = torch.Generator().manual_seed(rows * 1000 + k + n)
    x = torch.randn(rows, k, generator=gen)
    w = (torch.randn(n, k, generator=gen) / k**0.5).bfloat16().float()  # exactly bfloat16
    b = torch.randn(n, generator=gen) if bias else None
    return x, w, b


# 1-10 rows stack x's pieces in one or two tiles; 11-16 one tile; 17-32 a pair with a short
# second tile; 33 and more whole pairs and a padded last tile; 65 and 200: blocks of 64 rows.
@pytest.mark.parametrize("rows", [1, 3, 5, 6, 10, 11, 16, 17, 24, 32, 33, 48, 65, 200])
@pytest.mark.parametrize(
    ("in_features", "out_features"),
    [(256, 768), (100, 37), (768, 4), (64, 32), (48, 70)],  # K and N off the 32 grid too
)
@pytest.mark.parametrize("bias", [False, True])
def test_amx_linear_matches_torch(amx_lib, rows, in_features, out_features, bias):
    x, w, b = _case(rows, in_features, out_features, bias)
    packed = pack_bf16_weight(w, amx=True)
    assert packed is not None and amx_packed(packed)

    out = bf16_linear(amx_lib, x, packed, out_features, b)

    torch.testing.assert_close(out, F.linear(x, w, b), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("rows", [4, 24, 200])
def test_amx_linear_is_as_accurate_as_a_float32_gemm(amx_lib, rows):
    """Against float64: no worse than torch's float32 linear (dropping x's third piece, whose
    products are ~2^-16 of the first's, leaves errors ~100x larger: this fails then)."""
    x, w, b = _case(rows, 1024, 256, True)
    exact = F.linear(x.double(), w.double(), b.double())

    ours = (bf16_linear(amx_lib, x, pack_bf16_weight(w, amx=True), 256, b).double() - exact).abs()
    blas = (F.linear(x, w, b).double() - exact).abs()

    assert ours.max() <= 2 * blas.max()
    assert ours.mean() <= 2 * blas.mean()


@pytest.mark.parametrize("scale", [1.0, 1e30, 1e-30])  # the pieces keep x's exponent range
def test_amx_linear_takes_a_row_slice_and_any_magnitude(amx_lib, scale):
    gen = torch.Generator().manual_seed(7)
    x = (torch.randn(24, 64, generator=gen) * scale)[::2]
    w = torch.randn(48, 64, generator=gen).bfloat16().float()
    exact = F.linear(x.double(), w.double())

    out = bf16_linear(amx_lib, x, pack_bf16_weight(w, amx=True), 48, None)

    # Relative to the largest output: where sums cancel, float32 GEMMs differ from each other.
    assert (out.double() - exact).abs().max() <= 1e-6 * exact.abs().max()


def test_amx_packing_lays_out_the_tiles_tdpbf16ps_takes():
    n, k = 40, 70  # two panels (the second padded), three chunks (the last padded)
    w = torch.randn(n, k).bfloat16().float()
    packed = pack_bf16_weight(w, amx=True)
    assert packed.shape == (2, 3, 2, 16, 16, 2) and packed.dtype == torch.int16
    bits = w.bfloat16().view(torch.int16)
    padded = torch.zeros(64, 96, dtype=torch.int16)
    padded[:n, :k] = bits
    for p, c, h, r, f, e in [(0, 0, 0, 0, 0, 0), (0, 1, 1, 5, 3, 1), (1, 2, 0, 2, 7, 0)]:
        feature, kk = p * 32 + h * 16 + f, c * 32 + 2 * r + e
        assert packed[p, c, h, r, f, e] == padded[feature, kk]
    assert pack_bf16_weight(w + 2**-20, amx=True) is None  # off the bfloat16 grid


def test_use_cpu_kernels_packs_for_amx_where_it_runs(amx_lib):
    from tests.workers.device.layers.cpu_kernels.helpers import toy_model

    model = toy_model(bf16=True)
    proj_w, head_w = model.proj.weight.clone(), model.head.weight.clone()
    x = torch.randn(300, 32)

    use_cpu_kernels(model, amx_lib)

    assert amx_packed(model.proj.packed_weight) and amx_packed(model.head.packed_weight)
    assert on_amx_tiles(model)
    torch.testing.assert_close(model.proj(x), F.linear(x, proj_w, model.proj.bias))
    torch.testing.assert_close(model.head(x[:3]), F.linear(x[:3], head_w))


def test_builds_without_amx_say_so_and_refuse():
    """An AVX2 build has no AMX whatever the CPU: the engine packs for bf16_linear.c."""
    from tests.workers.device.layers.cpu_kernels.helpers import toy_model

    lib = avx2_build()
    assert not amx(lib)
    assert lib.amx_linear(None, None, None, None, 1, 32, 32, 1) == -2
    model = toy_model(bf16=True)
    use_cpu_kernels(model, lib)
    assert model.proj.packed_weight is not None and not on_amx_tiles(model)


def test_a_failed_gemm_call_raises():
    from workers.device.layers.cpu_kernels import check_gemm

    check_gemm(0)
    with pytest.raises(MemoryError):
        check_gemm(-1)
    with pytest.raises(RuntimeError, match="status -2"):
        check_gemm(-2)


def test_linear_routes_every_step_size_to_amx(amx_lib):
    """Faster than torch's linear at every size measured, so also above BF16_MAX_ROWS while
    the float32 weight is kept (the compiled pieces' path)."""
    from workers.device.layers.cpu_kernels.routing import BF16_MAX_ROWS, kernel_route
    from workers.device.layers.linear import linear

    w = torch.randn(64, 32).bfloat16().float()
    packed = pack_bf16_weight(w, amx=True)
    assert kernel_route(BF16_MAX_ROWS + 1, w, packed) == "bf16"
    assert kernel_route(BF16_MAX_ROWS + 1, w, pack_bf16_weight(w)) is None  # the FMA kernel's
    x = torch.randn(BF16_MAX_ROWS + 1, 32)
    torch.testing.assert_close(linear(x, w, None, amx_lib, packed), F.linear(x, w))

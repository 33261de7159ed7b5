"""The GEMM kernels (`kvray::linear` and the `out=` ops behind skinny_linear and bf16_linear)
against torch's linear, the bfloat16 packing, and the routing of a step's rows."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from workers.device.layers.cpu_kernels import (
    bf16_linear,
    kernel_route,
    pack_bf16_weight,
    skinny_linear,
)


@pytest.mark.parametrize("rows", [1, 3, 4, 7, 16, 24, 40])
@pytest.mark.parametrize(
    ("in_features", "out_features"),
    [(256, 768), (100, 37), (768, 4), (600, 9)],  # 600: a tail after the vector loop
)
@pytest.mark.parametrize("bias", [False, True])
def test_skinny_linear_matches_torch(lib, rows, in_features, out_features, bias):
    gen = torch.Generator().manual_seed(rows * 1000 + in_features + out_features)
    x = torch.randn(rows, in_features, generator=gen)
    w = torch.randn(out_features, in_features, generator=gen) / in_features**0.5
    b = torch.randn(out_features, generator=gen) if bias else None

    out = skinny_linear(lib, x, w, b)

    torch.testing.assert_close(out, F.linear(x, w, b), atol=1e-5, rtol=1e-5)


def test_skinny_linear_takes_a_row_slice(lib):
    # The LM head receives rows picked out of the step's hidden states: any layout works.
    x = torch.randn(12, 64)[::2]
    w = torch.randn(48, 64)
    torch.testing.assert_close(skinny_linear(lib, x, w, None), F.linear(x, w, None))


@pytest.mark.parametrize("rows", [1, 3, 8, 12, 13, 30, 96, 200])  # 200: two blocks of x
@pytest.mark.parametrize(
    ("in_features", "out_features"),
    [(256, 768), (100, 37), (768, 4), (64, 32), (48, 70)],  # partial panels, one panel
)
@pytest.mark.parametrize("bias", [False, True])
def test_bf16_linear_matches_torch_on_the_same_values(
    tiled_lib, rows, in_features, out_features, bias
):
    gen = torch.Generator().manual_seed(rows * 1000 + in_features + out_features)
    x = torch.randn(rows, in_features, generator=gen)
    w = (torch.randn(out_features, in_features, generator=gen) / in_features**0.5).bfloat16()
    w = w.float()  # exactly bfloat16 values, held in float32 as the engine holds them
    b = torch.randn(out_features, generator=gen) if bias else None
    packed = pack_bf16_weight(w)
    assert packed is not None

    out = bf16_linear(tiled_lib, x, packed, out_features, b)

    torch.testing.assert_close(out, F.linear(x, w, b), atol=1e-5, rtol=1e-5)


def test_bf16_packing_refuses_weights_that_are_not_bfloat16():
    w = torch.randn(40, 16).bfloat16().float()
    assert pack_bf16_weight(w) is not None
    w[3, 5] += 2**-20  # one value off the bfloat16 grid would change the layer
    assert pack_bf16_weight(w) is None


def test_bf16_linear_takes_a_row_slice(lib):
    x = torch.randn(12, 64)[::2]
    w = torch.randn(48, 64).bfloat16().float()
    out = bf16_linear(lib, x, pack_bf16_weight(w), 48, None)
    torch.testing.assert_close(out, F.linear(x, w, None))


def test_the_linear_kernels_write_into_a_given_output(lib):
    # The benchmarks time them into outputs allocated once, as the engine's step runs them.
    x, w = torch.randn(6, 64), torch.randn(48, 64).bfloat16().float()
    for linear in (
        lambda out: bf16_linear(lib, x, pack_bf16_weight(w), 48, None, out),
        lambda out: skinny_linear(lib, x, w, None, out),
    ):
        out = torch.full((6, 48), float("nan"))
        assert linear(out) is out
        torch.testing.assert_close(out, F.linear(x, w, None))
        for wrong in (torch.empty(6, 47), torch.empty(48, 6).t(), torch.empty(6, 48).double()):
            with pytest.raises(ValueError, match="out must be"):
                linear(wrong)


def test_linear_routes_rows_by_count_and_weight(lib):
    from workers.device.layers import linear as linear_mod
    from workers.device.layers.cpu_kernels import BF16_MAX_ROWS, register

    w32 = torch.randn(64, 32)
    w16 = w32.bfloat16().float()
    packed = pack_bf16_weight(w16)
    freed = torch.empty(64, 32, device="meta")
    for rows, w, p, expected in [
        (1, w16, packed, "bf16"),
        (BF16_MAX_ROWS, w16, packed, "bf16"),
        (BF16_MAX_ROWS + 1, w16, packed, None),  # the BLAS
        (1000, freed, packed, "bf16"),  # freed float32: the packed copy at every size
        (1000, None, packed, "bf16"),  # as the op sees a freed weight
        (8, w32, None, "skinny"),  # float32 weights: the skinny kernel
        (1, w32, None, None),
    ]:
        assert kernel_route(rows, w, p) == expected, (rows, expected)
        if w is None:
            continue
        x = torch.randn(rows, 32)
        out = linear_mod.linear(x, w, None, register(lib), p)
        torch.testing.assert_close(out, F.linear(x, w16 if w.is_meta else w), atol=1e-5, rtol=1e-5)

"""Fixtures of the kernel tests: the library built for this CPU, the AVX2 build, and the
real library reporting another vector width."""

from __future__ import annotations

import pytest

from tests.workers.device.layers.cpu_kernels.helpers import Width
from tests.workers.kernel_builds import avx2_build
from workers.device.layers.cpu_kernels import kernel, wide_vectors


@pytest.fixture(scope="module")
def lib():
    lib = kernel()
    if lib is None:
        pytest.skip("no C compiler: the engine uses the torch path")
    return lib


@pytest.fixture(scope="module", params=["native", "avx2"])
def tiled_lib(request, lib):
    """`lib`, then the same kernels built for AVX2 (-march=haswell): the bfloat16 GEMM's and
    the prefill kernel's register tiles for 32-byte vectors run on any AVX2 host."""
    return lib if request.param == "native" else avx2_build()


@pytest.fixture(scope="module")
def wide_lib(lib):
    """`lib`, reporting 64-byte vectors whatever it was built for: the routing to the GEMM and
    prefill kernels is tested on any host (without AVX-512 they are slow there, not wrong)."""
    return lib if wide_vectors(lib) else Width(lib, 64)

"""The CPU kernels as built for another vector width than this host's: their AVX2 register
tiles run on any host with AVX2 (an AVX-512 one included), so tests check them everywhere."""

from __future__ import annotations

import ctypes
from pathlib import Path

import pytest


def cpu_flags() -> set[str]:
    """This CPU's feature flags (/proc/cpuinfo), empty where there is none."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return set()
    return next((set(line.split()[2:]) for line in lines if line.startswith("flags")), set())


def avx2_build() -> ctypes.CDLL:
    """The kernels built with -march=haswell (AVX2 and FMA, 32-byte vectors), or a skip where
    this CPU cannot run them or nothing can be built."""
    from workers.device.layers.cpu_kernels.build import build

    if not {"avx2", "fma"} <= cpu_flags():
        pytest.skip("this CPU has no AVX2 and FMA")
    lib = build("haswell")
    if lib is None:
        pytest.skip("no C compiler: the engine uses the torch path")
    assert lib.kvray_vector_bytes() == 32
    return lib

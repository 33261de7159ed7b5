"""Runs kvray's Triton kernels on CPU through Triton's interpreter (TRITON_INTERPRET=1).

Triton reads TRITON_INTERPRET when a kernel is defined (`@triton.jit` returns an interpreted
function or a JIT one), so the variable must be set before workers.device.layers.
triton_attention is first imported; `interpreted_kernels` sets it and re-imports the
module if an earlier import defined its kernels for a GPU. The interpreter computes through
numpy: tests load and store float32 (it does no bfloat16 arithmetic).
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Iterator
from types import ModuleType

import pytest

MODULE = "workers.device.layers.triton_attention"


def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def interpreted_kernels(
    module: str = MODULE, kernel: str = "_paged_attention_kernel"
) -> Iterator[ModuleType]:
    """For a module-scoped fixture (`yield from interpreted_kernels()`): the kernel module
    `module` with its kernels interpreted (re-imported unless its `kernel` already is), and
    TRITON_INTERPRET=1 while the fixture lives (a worker checks it before choosing the
    triton backend on CPU)."""
    if not triton_available():
        pytest.skip("triton is not installed (pip install -e '.[dev]')")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITON_INTERPRET", "1")
        from triton.runtime.interpreter import InterpretedFunction

        mod = sys.modules.get(module) or importlib.import_module(module)
        if not isinstance(getattr(mod, kernel), InterpretedFunction):
            mod = importlib.reload(mod)
        yield mod

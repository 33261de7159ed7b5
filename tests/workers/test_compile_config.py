"""The compile switch (workers/compile_config.py): defaults per device, thresholds, refusals."""

from __future__ import annotations

import pytest

from workers.compile_config import CompilationConfig
from workers.compile_sizes import CPU_COMPILED_MIN_TOKENS, capture_sizes


def test_compile_switch_defaults_per_device() -> None:
    # Off on CPU unless asked (no win there: docs/benchmarks.md, "Compiled forward on CPU").
    assert CompilationConfig.resolve(None, "cpu", 256) == CompilationConfig()
    cpu = CompilationConfig.resolve(True, "cpu", 256)
    assert cpu.enabled and not cpu.cuda_graphs and cpu.capture_sizes == ()
    # Small CPU steps run eagerly (they lose under PASSIVE threads); 0 compiles them all.
    assert cpu.min_tokens == CPU_COMPILED_MIN_TOKENS > 1
    assert CompilationConfig.resolve(True, "cpu", 256, 0).min_tokens == 0
    assert CompilationConfig.resolve(True, "cuda", 64).min_tokens == 0
    with pytest.raises(ValueError, match="^compile_min_tokens must be"):
        CompilationConfig.resolve(True, "cpu", 8, -1)
    with pytest.raises(ValueError, match="^compile_min_tokens must be"):
        CompilationConfig.resolve(True, "cpu", 8, 1.5)  # type: ignore[arg-type]
    cuda = CompilationConfig.resolve(True, "cuda", 64)
    assert cuda.enabled and cuda.cuda_graphs and cuda.capture_sizes == capture_sizes(64)
    # Only the decode graphs run compiled on CUDA; an explicit threshold compiles every step.
    assert cuda.graphs_only and not CompilationConfig.resolve(True, "cuda", 64, 0).graphs_only
    assert not CompilationConfig.resolve(True, "cpu", 64).graphs_only
    # Off by default on CUDA too: a whole run lost there (docs/benchmarks.md, "On a GPU (H200)").
    assert not CompilationConfig.resolve(None, "cuda", 64).enabled
    with pytest.raises(ValueError, match="^compile must be"):
        CompilationConfig.resolve("yes", "cpu", 8)  # type: ignore[arg-type]

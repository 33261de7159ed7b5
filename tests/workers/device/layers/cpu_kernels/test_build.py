"""The kernel library's build (cache key, loading), what it reports it was built for, and the
state a worker logs and reports (`KernelState`)."""

from __future__ import annotations

import pytest
import torch

from tests.workers.device.layers.cpu_kernels.helpers import Width
from tests.workers.kernel_builds import cpu_flags
from workers.device.layers.cpu_kernels import tiled_kernels, wide_vectors


def test_the_cached_library_is_per_cpu_and_compiler():
    from workers.device.layers.cpu_kernels import library_name

    name = library_name(b"src", ["-O3"], "x86_64 flags: avx2 gcc 12")
    assert name.startswith("kvray-cpu-kernels-") and name.endswith(".so")
    assert name == library_name(b"src", ["-O3"], "x86_64 flags: avx2 gcc 12")
    others = [
        library_name(b"src", ["-O3"], "x86_64 flags: avx2 avx512f gcc 12"),  # another CPU
        library_name(b"src", ["-O3"], "x86_64 flags: avx2 gcc 13"),  # another compiler
        library_name(b"src2", ["-O3"], "x86_64 flags: avx2 gcc 12"),
        library_name(b"src", ["-O2"], "x86_64 flags: avx2 gcc 12"),
    ]
    assert name not in others and len(set(others)) == len(others)


def test_loading_the_kernel_keeps_denormals(lib):
    # Linking a library with -ffast-math would switch the whole process to flush-to-zero.
    tiny = torch.tensor([1e-39], dtype=torch.float32)
    assert (tiny * 0.5).item() > 0.0


def test_the_library_reports_the_vectors_it_was_built_for(lib):
    flags = cpu_flags()
    assert wide_vectors(lib) == ("avx512f" in flags)  # the build is -march=native
    assert tiled_kernels(lib) == ("avx2" in flags)
    assert tiled_kernels(Width(lib, 32)) and not wide_vectors(Width(lib, 32))
    assert not tiled_kernels(Width(lib, 16))


def test_the_kernel_state_names_what_runs_or_why_not(lib, monkeypatch):
    from workers.device.layers.cpu_kernels import KernelState, amx, kernel_state
    from workers.device.layers.cpu_kernels import build as build_mod

    level = "AMX" if amx(lib) else "AVX-512" if wide_vectors(lib) else "AVX2"
    assert str(kernel_state("cpu", True)) == f"on ({level})"
    assert str(KernelState.of(Width(lib, 16))) == "off: vectors narrower than 32 bytes"
    assert str(kernel_state("cuda", True)) == "off: CUDA device"
    assert str(kernel_state("cpu", False)) == "off: dtype is not float32"
    assert str(kernel_state("cpu", True, enabled=False)) == "off: disabled by config"
    monkeypatch.setattr(build_mod, "_compiler", lambda: None)
    assert str(KernelState.of(None)) == "off: no C compiler"


def test_a_worker_logs_the_state_once_and_reports_it(demo_dir, lib, caplog, monkeypatch):
    """The start-up line, the executor's info and the engine's stats say the same; the
    strategy is decided once, at the worker's start (the library is asked for once)."""
    import logging

    from workers import LLM
    from workers.device.layers.cpu_kernels import build as build_mod

    calls: list[int] = []

    def counted():  # noqa: ANN202
        calls.append(1)
        return lib

    monkeypatch.setattr(build_mod, "kernel", counted)
    with caplog.at_level(logging.INFO, logger="workers.device.worker"):
        llm = LLM(str(demo_dir), kv_cache_memory_bytes=8 << 20)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("CPU kernels:")]
    state = str(llm.engine.executor.worker.forward.strategy.kernels)
    assert state.startswith("on (") and lines == [f"CPU kernels: {state}"]
    assert llm.engine.executor.info()["cpu_kernels"] == state
    assert llm.stats().cpu_kernels == state
    llm.generate([[5, 6, 7]], use_tqdm=False)
    assert calls == [1]  # decided at start, not per step
    llm.engine.shutdown()

    caplog.clear()
    with caplog.at_level(logging.INFO, logger="workers.device.worker"):
        off = LLM(str(demo_dir), kv_cache_memory_bytes=8 << 20, cpu_kernels=False)
    assert "CPU kernels: off: disabled by config" in caplog.messages
    assert off.stats().cpu_kernels == "off: disabled by config"
    assert off.engine.executor.worker.forward.direct is None
    off.engine.shutdown()


def test_the_strategy_is_frozen():
    import dataclasses

    from workers.compile_config import CompilationConfig
    from workers.device.forward import ForwardStrategy

    strategy = ForwardStrategy.choose(
        torch.device("cpu"), torch.float32, CompilationConfig(), kernels_enabled=False
    )
    assert strategy.path == "torch" and not strategy.kernels.on
    with pytest.raises(dataclasses.FrozenInstanceError):
        strategy.compiled = True  # type: ignore[misc]
    compiled = ForwardStrategy.choose(
        torch.device("cpu"), torch.float32, CompilationConfig(enabled=True), False, tp_size=2
    )
    assert not compiled.compiled  # TP > 1 runs eagerly


def test_the_reported_path_is_what_runs():
    from workers.device.forward import ForwardStrategy, ModelForward
    from workers.device.layers.cpu_kernels import KernelState

    asked = ForwardStrategy(KernelState.off("disabled by config"), compiled=True)
    assert asked.path == "torch+compiled"
    # Compiling failed (compile_model gave None): every step runs eagerly, and says so.
    assert ModelForward(model=None, strategy=asked, compiled=None).path == "torch"
    assert ModelForward(model=None, strategy=asked, compiled=object()).path == "torch+compiled"


def test_building_ahead_of_time_prints_the_state(lib):
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-m", "workers.device.layers.cpu_kernels"],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    assert out.stdout.startswith("CPU kernels: on (")
    assert "RuntimeWarning" not in out.stderr

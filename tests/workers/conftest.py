"""Shared fixtures for engine tests: the demo checkpoint and the tiny parity checkpoints."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.checkpoints import KINDS, make_checkpoint


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("ckpt")
    return {kind: make_checkpoint(kind, root / kind) for kind in KINDS}


@pytest.fixture(scope="session")
def demo_llm(demo_dir: Path):  # noqa: ANN201
    from workers import LLM

    return LLM(str(demo_dir), kv_cache_memory_bytes=64 << 20)


@pytest.fixture(scope="session", autouse=True)
def _room_for_many_compiled_models() -> None:
    """One test process compiles the forward pass of many models (families, sizes, adapters,
    FP8), and Dynamo counts every variant of kvray's layer functions against one recompile
    limit per process (8): past it the engine logs the failure and runs eagerly, which the
    compile tests would catch. A serving process compiles one model."""
    import torch._dynamo

    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)

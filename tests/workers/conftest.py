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

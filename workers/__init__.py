"""kvray's engine: everything that runs on or next to an accelerator.

Public API: `LLM`, `SamplingParams`, `AsyncEngine`, `EngineArgs`. Submodules are imported
lazily so `import workers` stays cheap (no torch until an engine is built).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from workers.sampling_params import SamplingParams

if TYPE_CHECKING:
    from workers.async_engine import AsyncEngine
    from workers.config import EngineArgs
    from workers.llm import LLM

__all__ = ["LLM", "SamplingParams", "AsyncEngine", "EngineArgs"]


def __getattr__(name: str):  # noqa: ANN202
    if name == "LLM":
        from workers.llm import LLM

        return LLM
    if name == "AsyncEngine":
        from workers.async_engine import AsyncEngine

        return AsyncEngine
    if name == "EngineArgs":
        from workers.config import EngineArgs

        return EngineArgs
    raise AttributeError(name)

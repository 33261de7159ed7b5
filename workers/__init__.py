"""kvray's engine: everything that runs on or next to an accelerator.

By process: `frontend/` runs in the caller (offline `LLM`, a replica's `AsyncEngine`);
`core/` is the engine core (scheduler, KV blocks; no torch); `executor/` drives the
tensor-parallel ranks from the core's process; `device/` owns a device (worker, model,
layers, kernels). The modules at this level are the types all of them share.

Public API: `LLM`, `SamplingParams`, `AsyncEngine`, `EngineArgs`, and the request and output
types `EngineInput`, `InputChecker`, `RequestOutput`, `RequestOutputKind`. Heavy submodules
are imported lazily so `import workers` stays cheap (no torch until an engine is built).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from workers.inputs import EngineInput, InputChecker
from workers.outputs import CompletionOutput, RequestOutput, RequestOutputKind
from workers.sampling_params import SamplingParams

if TYPE_CHECKING:
    from workers.config import EngineArgs
    from workers.frontend.async_engine import AsyncEngine
    from workers.frontend.llm import LLM

__all__ = [
    "LLM",
    "AsyncEngine",
    "CompletionOutput",
    "EngineArgs",
    "EngineInput",
    "InputChecker",
    "RequestOutput",
    "RequestOutputKind",
    "SamplingParams",
]


def __getattr__(name: str):  # noqa: ANN202
    if name == "LLM":
        from workers.frontend.llm import LLM

        return LLM
    if name == "AsyncEngine":
        from workers.frontend.async_engine import AsyncEngine

        return AsyncEngine
    if name == "EngineArgs":
        from workers.config import EngineArgs

        return EngineArgs
    raise AttributeError(name)

"""The messages between `EngineProcess` (parent) and its engine child, one class per kind.

They cross one socket pair, pickled (`multiprocessing.connection.Connection`); plain frozen
dataclasses with slots keep that cheap. The order of a conversation:

    parent -> child   StartEngine, then any of AddRequest | AbortRequest, then StopEngine
    child -> parent   EngineReady | EngineFatal (start-up), then any of StepResult |
                      RequestRejected, then EngineStopped (after StopEngine) or EngineFatal
"""

from __future__ import annotations

from dataclasses import dataclass

from workers.config import EngineConfig
from workers.core.kv_events import KvEvent
from workers.core.stats import EngineStats
from workers.inputs import EngineInput, InputChecker
from workers.outputs import RequestOutput

# -- parent -> child ------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class StartEngine:
    """The first message: build the engine for this config."""

    config: EngineConfig


@dataclass(frozen=True, slots=True)
class AddRequest:
    request_id: str
    input: EngineInput  # checked by the caller; the child trusts it
    arrival_time: float  # time.monotonic() in the parent (the same clock in the child)
    queue_timeout_s: float | None = None  # unrun this long after arrival: a queue timeout


@dataclass(frozen=True, slots=True)
class AbortRequest:
    request_id: str


@dataclass(frozen=True, slots=True)
class StopEngine:
    """Shut the engine down and answer EngineStopped."""


# -- child -> parent ------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class EngineReady:
    num_blocks: int  # KV-cache blocks the engine has
    # The engine's limits, known only once its KV cache is sized (max_model_len is capped to
    # it): the parent checks requests against exactly these.
    input_checker: InputChecker


@dataclass(frozen=True, slots=True)
class StepResult:
    """Everything one engine step (plus the commands before it) produced."""

    outputs: list[RequestOutput]
    stats: EngineStats
    step_token_counts: list[int]  # tokens of each step since the previous StepResult
    kv_events: tuple[KvEvent, ...] = ()  # prefix-cache events of these steps (if recorded)


@dataclass(frozen=True, slots=True)
class RequestRejected:
    """The engine refused a request; its caller gets ValueError (bad_input) or RuntimeError."""

    request_id: str
    message: str
    bad_input: bool


@dataclass(frozen=True, slots=True)
class EngineFatal:
    """The engine failed to start or its step loop failed; the child is exiting."""

    message: str


@dataclass(frozen=True, slots=True)
class EngineStopped:
    """The answer to StopEngine: the engine is shut down."""


ToChild = StartEngine | AddRequest | AbortRequest | StopEngine
ToParent = EngineReady | StepResult | RequestRejected | EngineFatal | EngineStopped

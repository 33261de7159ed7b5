"""What `AsyncEngine` needs of an engine core, and what a core delivers to.

Two cores satisfy `EngineCore`: `workers.frontend.engine_thread.EngineThread` (the LLMEngine on a
thread of this process) and `workers.frontend.engine_process.EngineProcess` (the LLMEngine in a
child
process, off this interpreter's GIL). Both produce the same outputs for the same request:
whatever its `SamplingParams.output_kind` asks for (see `workers.outputs`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from workers.core.stats import EngineStats
    from workers.inputs import EngineInput, InputChecker
    from workers.outputs import RequestOutput


class OutputSink(Protocol):
    """Where an engine core delivers, from its own thread."""

    def outputs(self, outs: list[RequestOutput]) -> None: ...
    def rejected(self, request_id: str, err: Exception) -> None: ...
    def failed(self, cause: BaseException) -> None: ...
    def kv_events(self, events: tuple[Any, ...]) -> None: ...  # workers/core/kv_events.py


class EngineCore(Protocol):
    """Runs the engine's step loop on its own; commands may come from any thread."""

    tokenizer: Any
    model_name: str
    max_model_len: int
    input_checker: InputChecker

    def start(self, sink: OutputSink) -> None: ...
    # `inp` is trusted (checked already). `queue_timeout_s`: the request finishes unrun, as
    # a queue timeout (`workers.outputs.is_queue_timeout`), if no step has taken it by then.
    def add(
        self, request_id: str, inp: EngineInput, queue_timeout_s: float | None = None
    ) -> None: ...
    def abort(self, request_id: str) -> None: ...
    def stats(self) -> EngineStats: ...
    def pop_step_token_counts(self) -> list[int]: ...
    def is_alive(self) -> bool: ...  # cheap: no round trip to the ranks
    # Cheap and never blocking: EngineDeadError when dead, or when work is pending and no step
    # completed in step_timeout_s (which fails the engine and every waiting caller).
    def check_progress(self) -> None: ...
    # check_progress, plus the executor's own check (TP > 1: a blocking ping of every rank).
    def check_health(self) -> None: ...
    def shutdown(self) -> None: ...

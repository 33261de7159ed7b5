"""A launched step's output, which may still be on its way to the host (async scheduling)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from workers.messages.step import StepOutput


class PendingStep(Protocol):
    def result(self) -> StepOutput: ...


class Resolved:
    """A step output already in hand, as a PendingStep."""

    def __init__(self, output: StepOutput) -> None:
        self._output = output

    def result(self) -> StepOutput:
        return self._output


@dataclass(frozen=True)
class Launched:
    """A step the engine launched, and whether the next step must wait for its tokens on the
    host (a constrained sequence's next mask, a penalised one's counts, come from them)."""

    pending: PendingStep
    seqs: dict[str, Any]  # seq_id -> the engine's Seq the step computed for
    host_bound: bool
    # Speculative decoding: seq_id -> the draft its chunk verifies (its k + 1 sampled rows
    # come back consecutively).
    drafts: dict[str, list[int]] = field(default_factory=dict)

"""A thinking-token budget (vLLM's `thinking_token_budget`, Anthropic's `thinking.budget_tokens`):
`ThinkingBudget`, what a request asks for, and `ThinkingState`, one sequence's place in it.

A reasoning model writes `<think> ... </think>` before its answer and can spend all of
max_tokens thinking. Once a sequence has written `budget` tokens inside its reasoning block
without closing it, the engine forces the end-of-reasoning marker's ids, one per step (its
mask row allows that id alone, workers/structured/decoding.py), and the model then writes its
answer. A grammar waiting for the same marker (`StructuredOutputs.after`) wakes after the
forced marker exactly as after a natural one: it only looks at the outputs.

The block starts with the outputs (`inside`: the prompt opened it) or once the outputs end with
`start_ids`; without either, the budget never applies. Only the first block is budgeted, and a
marker the model writes itself ends it. The state follows the generated tokens alone, so
preemption needs nothing, and a resumed sequence replays its earlier outputs into a new state.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ThinkingBudget:
    """At most `budget` reasoning tokens, then the marker `end_ids` is forced."""

    budget: int
    end_ids: tuple[int, ...]  # the end-of-reasoning marker's ids (`</think>`)
    start_ids: tuple[int, ...] = ()  # the start marker's ids, watched for when not `inside`
    inside: bool = True  # the outputs start inside the block (the prompt opened `<think>`)

    def __post_init__(self) -> None:
        for name in ("end_ids", "start_ids"):
            if isinstance(getattr(self, name), list):
                object.__setattr__(self, name, tuple(getattr(self, name)))
        if not _is_int(self.budget) or self.budget < 0:
            raise ValueError(f"thinking_budget.budget must be an integer >= 0, got {self.budget!r}")
        if not isinstance(self.end_ids, tuple) or not self.end_ids or not _ids(self.end_ids):
            raise ValueError(
                "thinking_budget.end_ids must be a non-empty list of token ids "
                f"(non-negative ints), got {self.end_ids!r}"
            )
        if not isinstance(self.start_ids, tuple) or not _ids(self.start_ids):
            raise ValueError(
                "thinking_budget.start_ids must be a list of token ids (non-negative ints), "
                f"got {self.start_ids!r}"
            )
        if not isinstance(self.inside, bool):
            raise ValueError(f"thinking_budget.inside must be a bool, got {self.inside!r}")

    @property
    def applies(self) -> bool:
        """False when no block can ever start (not inside, no start marker to watch for)."""
        return self.inside or bool(self.start_ids)


class Phase(enum.Enum):
    WAITING = "waiting"  # for the start marker
    COUNTING = "counting"  # inside the block, under budget
    FORCING = "forcing"  # writing the end marker, one id per token
    DONE = "done"  # the block closed (naturally or forced): the budget no longer applies


class ThinkingState:
    """One sequence's place in its budget; `advance` it with each output token, in order."""

    __slots__ = ("spec", "phase", "reasoning", "k", "host_bound", "_tail", "_keep")

    def __init__(self, spec: ThinkingBudget) -> None:
        self.spec = spec
        self.reasoning = 0  # tokens written inside the block (not the forced marker's)
        self.k = 0  # while forcing: the index in end_ids of the id forced next
        # The last outputs, as many as the longer marker: enough to see one end.
        self._tail: list[int] = []
        self._keep = max(len(spec.end_ids), len(spec.start_ids))
        self.phase = Phase.WAITING if spec.start_ids else Phase.DONE
        if spec.inside:
            self._open()
        self.host_bound = self._host_bound()

    @property
    def forced(self) -> int | None:
        """The token id this sequence must take next; None when its tokens are free."""
        return self.spec.end_ids[self.k] if self.phase is Phase.FORCING else None

    @property
    def done(self) -> bool:
        return self.phase is Phase.DONE

    def advance(self, token: int) -> None:
        """Moves past the sequence's next output token."""
        tail = self._tail
        tail.append(token)
        if len(tail) > self._keep:
            del tail[0]
        phase, spec = self.phase, self.spec
        if phase is Phase.COUNTING:
            self.reasoning += 1
            end = spec.end_ids
            if token == end[-1] and self.reasoning >= len(end) and ends_with(tail, end):
                self.phase = Phase.DONE  # closed by the model itself, within budget
            elif self.reasoning >= spec.budget:
                self._force()
        elif phase is Phase.FORCING:
            if token == spec.end_ids[self.k]:
                self.k += 1
                if self.k == len(spec.end_ids):
                    self.phase = Phase.DONE
            else:
                # Only a sampler that did not apply the mask (or an active grammar's row,
                # which wins over the budget) gets here: write the whole marker again.
                self.k = 0
        elif phase is Phase.WAITING and token == spec.start_ids[-1]:
            if ends_with(tail, spec.start_ids):
                self._open()
        self.host_bound = self._host_bound()

    def _open(self) -> None:
        self.phase = Phase.COUNTING
        self.reasoning = 0
        if self.spec.budget == 0:
            self._force()

    def _force(self) -> None:
        """Forces the marker, continuing a prefix of it the block already ends with (the model
        had begun to close it): the marker is then written once, not after a stray prefix."""
        self.phase = Phase.FORCING
        end = self.spec.end_ids
        block = self._tail[len(self._tail) - min(self.reasoning, len(self._tail)) :]
        self.k = next(
            (j for j in range(min(len(end) - 1, len(block)), 0, -1) if ends_with(block, end[:j])),
            0,
        )

    def _host_bound(self) -> bool:
        """Whether the engine must know the token in flight before the next step's mask.

        With async scheduling the state may lag the outputs by one token (the step before
        the one launched may still be in flight) and the step launched samples one more: the
        mask after those two can be forced only when two more tokens may exhaust the budget.
        Far from it, the reasoning runs without a host round trip per step."""
        phase = self.phase
        if phase is Phase.COUNTING:
            return self.reasoning + 2 >= self.spec.budget
        if phase is Phase.WAITING:
            return self.spec.budget <= 1  # the start marker, then one counted token
        return phase is Phase.FORCING


def start_state(spec: ThinkingBudget, outputs: list[int]) -> ThinkingState | None:
    """A sequence's state after its earlier `outputs` (a resumed sample; none otherwise);
    None when the budget no longer (or never) applies to it."""
    if not spec.applies:
        return None
    state = ThinkingState(spec)
    for token in outputs:
        if state.done:
            break
        state.advance(token)
    return None if state.done else state


def ends_with(tokens: list[int], marker: tuple[int, ...]) -> bool:
    """`tokens` end with the ids of `marker`."""
    k = len(marker)
    return len(tokens) >= k and tuple(tokens[-k:]) == marker


def is_token_id(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _ids(ids: tuple[object, ...]) -> bool:
    return all(is_token_id(t) for t in ids)


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)

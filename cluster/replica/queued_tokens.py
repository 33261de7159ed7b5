"""Admission by prompt tokens: what a replica's waiting queue costs is its prefill.

`max_queued_requests` counts samples; one 30,000-token prompt is as much queued work as two
hundred short ones, and a queue of long prompts keeps every request behind it waiting. So a
replica also refuses (429) a request when the prompt tokens waiting for the engine, plus this
request's, would pass `max_queued_tokens`:

    waiting = engine-reported tokens still to prefill (EngineStats.num_waiting_prefill_tokens)
              + tokens of requests admitted here that those stats may not show yet
    refuse when waiting > 0 and waiting + cost > max_queued_tokens

where `cost` is the request's prompt tokens times the samples it runs (a resumed sample
recomputes its outputs too). A request over the limit on its own is taken when nothing waits,
so a big prompt is never starved, only made to wait for an empty queue.

The engine's stats are a snapshot of its last step (workers/core/engine_child.py sends one
after
each step). A request admitted when the engine had done `s` steps may arrive while step s + 1
is already scheduled, so it shows in the stats of step s + 2 at the latest: until then it is
counted here. It may show earlier, and is then counted twice for a step: the error is on the
side of refusing, and lasts one step.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from cluster.errors import QueueFullError
from workers.core.stats import EngineStats
from workers.inputs import EngineInput

# Steps after the one current at admission by which the engine's stats include a request.
STEPS_TO_SHOW = 2


def prompt_cost(inp: EngineInput) -> int:
    """Tokens this request gives the engine to prefill: the prompt once per sample it runs
    (a resumed sample: the prompt plus the outputs it recomputes)."""
    prompt = len(inp.prompt_token_ids)
    if inp.resume:
        return sum(prompt + len(s.output_token_ids) for s in inp.resume)
    return prompt * inp.params.n


@dataclass
class QueuedTokens:
    """One replica's count of waiting prompt tokens, and its admission check (module doc)."""

    limit: int
    # Requests admitted here that the engine's stats may not show yet:
    # request id -> (the engine's step count at admission, tokens).
    _unseen: dict[str, tuple[int, int]] = field(default_factory=dict)

    def waiting(self, stats: EngineStats) -> int:
        """Prompt tokens waiting on this replica, as of `stats` and the admissions since."""
        steps = stats.num_steps
        for rid, (admitted_at, _) in list(self._unseen.items()):
            # A step count below the admission's: the engine was rebuilt and starts at 0.
            if steps >= admitted_at + STEPS_TO_SHOW or steps < admitted_at:
                del self._unseen[rid]
        unseen = sum(tokens for _, tokens in self._unseen.values())
        return stats.num_waiting_prefill_tokens + unseen

    def admit(
        self,
        request_id: str,
        cost: int,
        stats: EngineStats,
        under_share: Callable[[int, int], bool] | None = None,
    ) -> None:
        """Counts the request in, or raises QueueFullError (429) naming the limit. Over the
        limit, `under_share(waiting, limit)` True takes it anyway: its tenant holds less than
        its share of the limit (cluster/replica/tenant_share.py)."""
        waiting = self.waiting(stats)
        over = waiting > 0 and waiting + cost > self.limit
        if over and not (under_share is not None and under_share(waiting, self.limit)):
            raise QueueFullError(
                f"too many prompt tokens waiting on this replica ({waiting} + this request's "
                f"{cost} > max_queued_tokens={self.limit}); retry later"
            )
        self._unseen[request_id] = (stats.num_steps, cost)

    def release(self, request_id: str) -> None:
        """The request ended here (finished, refused by the engine, aborted): not waiting."""
        self._unseen.pop(request_id, None)

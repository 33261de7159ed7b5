"""A mixture-of-experts engine's tokens per expert (EngineStats.moe_expert_tokens), kept current.

The driver worker reports the cumulative counts with a step only about once a second (each
report is a host sync: workers/device/worker.py EXPERT_REPORT_S). A busy engine's counts are
so at most a second old; an engine that goes idle would keep those of its last report until
the next request runs, so the last second of every burst would show late (or never, on a
replica that gets no more traffic). So when the last request finishes, the engine asks the
driver for the counts with an empty step.

The engine is passed in (workers.core.engine.LLMEngine), not imported: no import cycle.
"""

from __future__ import annotations

from typing import Any

from workers.messages.step import StepInput

ExpertTokens = tuple[tuple[int, ...], ...]


def latest_expert_tokens(current: ExpertTokens, reported: ExpertTokens | None) -> ExpertTokens:
    """The newer of two reports of one engine's cumulative counts. With async scheduling an
    idle report can be newer than the one of the step still in flight, which resolves
    after it; counts never go down within an engine, so the larger total is the newer."""
    if reported is None or sum(map(sum, reported)) < sum(map(sum, current)):
        return current
    return reported


def report_experts_if_idle(engine: Any) -> None:
    """Once no request is left, the counts as of the last step (module doc); dense models
    (never a report) and engines whose counts are current already do nothing."""
    if engine.requests or not engine.moe_expert_tokens:
        return
    if engine.expert_tokens_step == engine.num_steps:
        return
    out = engine.executor.execute(StepInput(report_experts=True))
    engine.moe_expert_tokens = latest_expert_tokens(engine.moe_expert_tokens, out.expert_tokens)
    engine.expert_tokens_step = engine.num_steps

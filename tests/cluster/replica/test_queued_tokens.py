"""Admission by prompt tokens (cluster/replica/queued_tokens.py): the arithmetic, on its own."""

from __future__ import annotations

import pytest

from cluster.errors import QueueFullError
from cluster.replica.queued_tokens import STEPS_TO_SHOW, QueuedTokens, prompt_cost
from workers.core.stats import EngineStats
from workers.inputs import EngineInput, ResumedSample
from workers.sampling_params import SamplingParams


def _inp(prompt_len: int, n: int = 1, resumed: tuple[int, ...] = ()) -> EngineInput:
    resume = tuple(
        ResumedSample(index=i, output_token_ids=tuple(range(k)), text_sent=0)
        for i, k in enumerate(resumed)
    )
    return EngineInput(tuple(range(prompt_len)), SamplingParams(n=n), resume=resume)


def _stats(waiting: int = 0, steps: int = 0) -> EngineStats:
    return EngineStats(num_waiting_prefill_tokens=waiting, num_steps=steps)


def test_cost_is_prompt_times_samples_and_a_resumed_sample_recomputes_its_outputs() -> None:
    assert prompt_cost(_inp(100)) == 100
    assert prompt_cost(_inp(100, n=4)) == 400
    # Two of four samples resumed, with 5 and 7 outputs: only they run, outputs recomputed.
    assert prompt_cost(_inp(100, n=4, resumed=(5, 7))) == 105 + 107


def test_refuses_past_the_limit_naming_it_and_a_short_one_still_fits() -> None:
    q = QueuedTokens(limit=500)
    q.admit("a", 200, _stats())
    q.admit("b", 200, _stats())
    assert q.waiting(_stats()) == 400
    with pytest.raises(QueueFullError, match=r"400 \+ this request's 200 > max_queued_tokens=500"):
        q.admit("c", 200, _stats())
    q.admit("d", 100, _stats())  # exactly at the limit: taken
    assert q.waiting(_stats()) == 500
    with pytest.raises(QueueFullError) as err:
        q.admit("e", 1, _stats())
    assert err.value.http_status == 429 and err.value.retry_after_s >= 1


def test_a_request_over_the_limit_alone_is_taken_when_nothing_waits() -> None:
    q = QueuedTokens(limit=100)
    q.admit("big", 10_000, _stats())
    with pytest.raises(QueueFullError):
        q.admit("next", 1, _stats())
    q.release("big")
    q.admit("big-again", 10_000, _stats())  # empty queue again: never starved
    with pytest.raises(QueueFullError):  # the engine's own waiting tokens count too
        QueuedTokens(limit=100).admit("x", 10_000, _stats(waiting=1))


def test_admitted_tokens_count_until_the_engine_stats_can_show_them() -> None:
    q = QueuedTokens(limit=1000)
    q.admit("a", 300, _stats(waiting=50, steps=7))
    # The engine's stats of the next steps may not include it yet: counted here on top.
    assert q.waiting(_stats(waiting=50, steps=7)) == 350
    assert q.waiting(_stats(waiting=50, steps=7 + STEPS_TO_SHOW - 1)) == 350
    # From then on the engine reports it (or has prefilled it): only the engine's figure.
    assert q.waiting(_stats(waiting=300, steps=7 + STEPS_TO_SHOW)) == 300
    assert q.waiting(_stats(waiting=300, steps=7)) == 300  # forgotten for good


def test_released_and_rebuilt_engine_forget_admissions() -> None:
    q = QueuedTokens(limit=1000)
    q.admit("a", 300, _stats(steps=40))
    q.admit("b", 200, _stats(steps=40))
    q.release("a")  # finished, aborted or refused by the engine before it showed
    assert q.waiting(_stats(steps=40)) == 200
    assert q.waiting(_stats(steps=3)) == 0  # step count went down: a new engine
    q.release("never-admitted")  # harmless


def test_over_the_limit_a_tenant_under_its_share_is_taken_anyway() -> None:
    q = QueuedTokens(limit=500)
    q.admit("a", 400, _stats())
    asked: list[tuple[int, int]] = []

    def under(waiting: int, limit: int) -> bool:
        asked.append((waiting, limit))
        return True

    q.admit("b", 200, _stats(), under)
    assert asked == [(400, 500)] and q.waiting(_stats()) == 600
    with pytest.raises(QueueFullError):
        q.admit("c", 200, _stats(), lambda waiting, limit: False)
    below = QueuedTokens(limit=500)
    below.admit("d", 1, _stats(), lambda waiting, limit: pytest.fail("asked below the limit"))

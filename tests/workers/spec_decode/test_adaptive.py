"""The draft length rule (workers/spec_decode/adaptive.py)."""

from __future__ import annotations

import pytest

from workers.spec_decode.adaptive import (
    PROBE_EVERY,
    SeqAcceptance,
    StepCost,
    draft_length,
)


def test_the_step_cost_is_fitted_from_steps_of_different_sizes() -> None:
    cost = StepCost()
    assert cost.coefficients() is None and cost.threshold(8, 8) == 0.0
    for tokens in (1, 4, 16, 64, 1, 4, 16, 64):
        cost.record(tokens, 0.010 + 0.0005 * tokens)
    a, b = cost.coefficients()
    assert a == pytest.approx(0.010, rel=1e-6) and b == pytest.approx(0.0005, rel=1e-6)
    # c = b*T / (a + b*N): small at batch 1, near 1 at a large batch.
    assert cost.threshold(1, 1) == pytest.approx(0.0005 / 0.0105)
    assert cost.threshold(256, 256) > 0.9


def test_steps_of_one_size_teach_nothing() -> None:
    cost = StepCost()
    for _ in range(20):
        cost.record(8, 0.02)
    assert cost.coefficients() is None


def test_drafts_follow_acceptance_and_the_threshold() -> None:
    good, poor = SeqAcceptance(alpha=0.9), SeqAcceptance(alpha=0.3)
    assert draft_length(good, 4, 0.0) == 4 and draft_length(poor, 4, 0.0) == 4
    assert draft_length(good, 4, 0.5) == 4  # 0.9^4 = 0.66 > 0.5
    assert draft_length(poor, 4, 0.5) == 0  # 0.3 < 0.5
    assert draft_length(good, 4, 0.75) == 2  # 0.81 > 0.75 >= 0.729
    assert draft_length(good, 2, 0.0) == 2  # never past the limit
    poor.steps_without = PROBE_EVERY  # a periodic probe while drafts are cheap...
    assert draft_length(poor, 4, 0.5) == 1
    assert draft_length(poor, 4, 0.95) == 0  # ...not at a batch where they cost


def test_acceptance_moves_towards_what_the_sequence_shows() -> None:
    acc = SeqAcceptance()
    for _ in range(20):
        acc.record(4, 0)
    assert acc.alpha < 0.01
    for _ in range(20):
        acc.record(4, 4)
    assert acc.alpha > 0.99

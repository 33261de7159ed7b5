"""SamplingParams' own validation: non-finite floats are errors naming the field (the
engine, the offline LLM and both ingresses share this check)."""

from __future__ import annotations

import math

import pytest

from workers.sampling_params import SamplingParams
from workers.structured.thinking import ThinkingBudget

FLOAT_FIELDS = (
    "temperature",
    "top_p",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
)


@pytest.mark.parametrize("field", FLOAT_FIELDS)
@pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan])
def test_non_finite_floats_name_the_field(field: str, value: float) -> None:
    with pytest.raises(ValueError, match=rf"^{field} must be a finite number"):
        SamplingParams(**{field: value})


def test_finite_extremes_are_still_accepted() -> None:
    # Large but finite values keep their documented meaning (temperature has no upper bound).
    params = SamplingParams(temperature=1e6, repetition_penalty=1e6, presence_penalty=2.0)
    assert params.temperature == 1e6 and params.repetition_penalty == 1e6


def test_ints_count_as_numbers_bools_do_not() -> None:
    assert SamplingParams(temperature=0, top_p=1).temperature == 0
    with pytest.raises(ValueError, match="^temperature "):
        SamplingParams(temperature=True)


def test_derived_params_are_a_copy_not_validated_again(monkeypatch: pytest.MonkeyPatch) -> None:
    params = SamplingParams(seed=3, stop=["x"])
    calls: list[SamplingParams] = []
    monkeypatch.setattr(SamplingParams, "validate", lambda self: calls.append(self))
    sample = params.derived(seed=4, eos_token_ids=(2,))
    assert calls == []  # the engine derives per-sample params from checked ones
    assert (sample.seed, sample.eos_token_ids, sample.stop) == (4, (2,), ["x"])
    assert (params.seed, params.eos_token_ids) == (3, ())  # the original is unchanged


def test_thinking_budget_must_be_a_thinking_budget() -> None:
    budget = ThinkingBudget(8, (1131, 425))
    assert SamplingParams(thinking_budget=budget).thinking_budget is budget
    with pytest.raises(ValueError, match="^thinking_budget must be a ThinkingBudget, got dict"):
        SamplingParams(thinking_budget={"budget": 8})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"^thinking_budget\.budget must be an integer >= 0"):
        ThinkingBudget(-1, (1131,))

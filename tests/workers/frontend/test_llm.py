"""The offline LLM's checks: what its prompts share is checked once, each prompt after it."""

from __future__ import annotations

from typing import Any

import pytest

from workers import SamplingParams


def test_one_params_for_many_prompts_is_validated_once(
    demo_llm: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    params = SamplingParams(max_tokens=2, temperature=0.0)  # built before counting
    calls: list[SamplingParams] = []
    validate = SamplingParams.validate

    def counted(self: SamplingParams) -> None:
        calls.append(self)
        validate(self)

    monkeypatch.setattr(SamplingParams, "validate", counted)
    prompts = [[5, 6, 7 + i] for i in range(6)]
    outs = demo_llm.generate(prompts, params, use_tqdm=False)
    assert [list(o.prompt_token_ids) for o in outs] == prompts
    # Once for the final-only copy the engine is given, once by the input check: not per prompt.
    assert len(calls) == 2
    calls.clear()
    with pytest.raises(ValueError, match=r"^prompt token id 10000000 is outside"):
        demo_llm.generate([[5], [10**7]], params, use_tqdm=False)
    assert not demo_llm.engine.has_unfinished()  # nothing was admitted

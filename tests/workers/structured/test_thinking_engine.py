"""A thinking budget end to end with the demo model (whose tokenizer writes "</think>" as five
ids): the reasoning is exactly the unconstrained run's first `budget` tokens, then the forced
marker, then the model's own continuation; under async scheduling too, with a grammar after
the marker, for a start marker, for resumed samples and for seeded samples of n = 2."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from workers import LLM, SamplingParams
from workers.inputs import ResumedSample
from workers.structured import StructuredOutputs
from workers.structured.thinking import ThinkingBudget

PROMPT = "Think first, then answer:"
MAX = 40


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "async"])
def llm(request: pytest.FixtureRequest, demo_dir: Path) -> Iterator[LLM]:
    llm = LLM(str(demo_dir), kv_cache_memory_bytes=16 << 20, async_scheduling=request.param)
    yield llm
    llm.engine.shutdown()


@pytest.fixture(scope="module")
def marker(llm: LLM) -> tuple[int, ...]:
    ids = tuple(llm.tokenizer.encode("</think>"))
    assert len(ids) > 1
    return ids


def _run(llm: LLM, prompt: str | list[int], **kw: object) -> list:
    params = SamplingParams(**{"temperature": 0.0, "max_tokens": MAX, "ignore_eos": True, **kw})
    return llm.generate([prompt], params, use_tqdm=False)[0].outputs


def _greedy(llm: LLM, prompt: str | list[int] = PROMPT, **kw: object) -> list[int]:
    return list(_run(llm, prompt, **kw)[0].token_ids)


def _has(ids: list[int], marker: tuple[int, ...]) -> bool:
    k = len(marker)
    return any(tuple(ids[e - k : e]) == marker for e in range(k, len(ids) + 1))


@pytest.mark.parametrize("budget", [0, 1, 6, 13])
def test_reasoning_is_cut_at_the_budget_by_the_marker(
    llm: LLM, marker: tuple[int, ...], budget: int
) -> None:
    ref = _greedy(llm)
    assert not _has(ref, marker)  # the demo model never closes by itself
    assert all(ref[budget - j : budget] != list(marker[:j]) for j in range(1, len(marker)))
    out = _greedy(llm, thinking_budget=ThinkingBudget(budget, marker))
    end = budget + len(marker)
    assert out[:budget] == ref[:budget] and tuple(out[budget:end]) == marker
    # Then free: the model's own greedy continuation of what it has written.
    prompt_ids = llm.tokenizer.encode(PROMPT)
    rest = _run(llm, [*prompt_ids, *out[:end]], max_tokens=MAX - end)[0].token_ids
    assert out[end:] == list(rest)


def test_a_grammar_after_the_marker_applies_after_the_forced_one(
    llm: LLM, marker: tuple[int, ...]
) -> None:
    ref, budget, pattern = _greedy(llm), 5, r"[0-9]{3}-[a-z]{2}"
    spec = StructuredOutputs(regex=pattern).starting_after(marker)
    params = SamplingParams(
        temperature=0.0,
        max_tokens=60,
        structured_outputs=spec,
        thinking_budget=ThinkingBudget(budget, marker),
    )
    [c] = llm.generate([PROMPT], params, use_tqdm=False)[0].outputs
    end = budget + len(marker)
    assert c.token_ids[:budget] == ref[:budget] and tuple(c.token_ids[budget:end]) == marker
    assert re.fullmatch(pattern, llm.tokenizer.decode(c.token_ids[end:])), c.text
    assert c.finish_reason == "stop"


def test_a_block_closed_before_the_budget_is_untouched(llm: LLM) -> None:
    ref = _greedy(llm)
    # A marker the greedy run writes itself early (two ids, at their first occurrence).
    end = next(e for e in range(3, 12) if not _has(ref[: e - 1], tuple(ref[e - 2 : e])))
    closing = tuple(ref[end - 2 : end])
    assert _greedy(llm, thinking_budget=ThinkingBudget(end + 2, closing)) == ref
    # The same marker with a smaller budget is forced at the budget instead.
    out = _greedy(llm, thinking_budget=ThinkingBudget(1, closing))
    assert out[:3] == [ref[0], *closing]


def test_not_inside_counting_starts_after_the_start_marker(
    llm: LLM, marker: tuple[int, ...]
) -> None:
    ref = _greedy(llm)
    s = next(e for e in range(4, 12) if not _has(ref[: e - 1], tuple(ref[e - 2 : e])))
    start, budget = tuple(ref[s - 2 : s]), 3
    out = _greedy(llm, thinking_budget=ThinkingBudget(budget, marker, start, inside=False))
    assert out[: s + budget] == ref[: s + budget]
    assert tuple(out[s + budget : s + budget + len(marker)]) == marker
    # A start marker that never comes: never counted, never forced.
    absent = tuple(llm.tokenizer.encode("<think>"))
    assert not _has(ref, absent)
    assert _greedy(llm, thinking_budget=ThinkingBudget(0, marker, absent, inside=False)) == ref


def test_a_resumed_sample_mid_marker_continues_forcing_it(
    llm: LLM, marker: tuple[int, ...]
) -> None:
    budget = 4
    params = SamplingParams(
        temperature=0.0,
        max_tokens=MAX,
        ignore_eos=True,
        thinking_budget=ThinkingBudget(budget, marker),
    )
    whole = _greedy(llm, thinking_budget=params.thinking_budget)
    eng = llm.engine
    inp = eng.input_checker.check_prompt(PROMPT, params, eng.tokenizer)
    earlier = tuple(whole[: budget + 2])  # two of the marker's ids written
    inp = dataclasses.replace(inp, resume=(ResumedSample(0, earlier, text_sent=0),))
    eng.add_request("resumed", inp)
    seq = eng.requests["resumed"].seqs[0]
    assert seq.thinking.forced == marker[2]
    while eng.has_unfinished():
        eng.step()
    assert seq.output_token_ids == whole


def test_each_seeded_sample_is_forced_on_its_own(llm: LLM, marker: tuple[int, ...]) -> None:
    budget = 7
    kw = {"n": 2, "seed": 11, "temperature": 1.0, "max_tokens": 20, "ignore_eos": True}
    free = llm.generate([PROMPT], SamplingParams(**kw), use_tqdm=False)[0].outputs
    capped = SamplingParams(**kw, thinking_budget=ThinkingBudget(budget, marker))
    outs = llm.generate([PROMPT], capped, use_tqdm=False)[0].outputs
    assert free[0].token_ids[:budget] != free[1].token_ids[:budget]  # two different samples
    for f, c in zip(free, outs, strict=True):
        assert not _has(list(f.token_ids[:budget]), marker)
        assert c.token_ids[:budget] == f.token_ids[:budget]  # seeded: the same draws
        assert tuple(c.token_ids[budget : budget + len(marker)]) == marker

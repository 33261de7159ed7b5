"""A thinking budget: `ThinkingBudget`'s validation, `ThinkingState` (counting, forcing the
end marker one id at a time, done), the mask rows StructuredDecoding gives forcing sequences
(with and without a grammar), replay of resumed outputs, and the host-bound rule that lets
async scheduling lag one token behind far from the budget."""

from __future__ import annotations

import copy
import random

import numpy as np
import pytest

from workers import SamplingParams
from workers.core.request import Request, Seq
from workers.structured import StructuredOutputs
from workers.structured.decoding import StructuredDecoding
from workers.structured.thinking import Phase, ThinkingBudget, ThinkingState, start_state
from workers.tokenizer import Tokenizer

END = (1131, 425, 262, 77, 32)  # the demo tokenizer's "</think>"
START = (30, 425, 262, 77, 32)  # its "<think>"
FREE = [90, 67, 671, 15, 25]  # "x", "a", " x", "-", "7"
D, DASH = 25, 15


# -- ThinkingBudget ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"budget": -1}, "budget must be an integer >= 0"),
        ({"budget": 1.5}, "budget must be an integer >= 0"),
        ({"budget": True}, "budget must be an integer >= 0"),
        ({"end_ids": ()}, "end_ids must be a non-empty list"),
        ({"end_ids": (1, -2)}, "end_ids must be a non-empty list"),
        ({"end_ids": (1, True)}, "end_ids must be a non-empty list"),
        ({"end_ids": "</think>"}, "end_ids must be a non-empty list"),
        ({"start_ids": (1.0,)}, "start_ids must be a list of token ids"),
        ({"start_ids": 5}, "start_ids must be a list of token ids"),
        ({"inside": 1}, "inside must be a bool"),
    ],
)
def test_budget_validation_names_the_field(kwargs: dict, match: str) -> None:
    args = {"budget": 4, "end_ids": END, **kwargs}
    with pytest.raises(ValueError, match=rf"^thinking_budget\.{match}"):
        ThinkingBudget(**args)


def test_budget_lists_become_tuples_and_it_hashes() -> None:
    b = ThinkingBudget(3, list(END), start_ids=list(START), inside=False)
    assert b.end_ids == END and b.start_ids == START and b.applies
    assert hash(b) == hash(ThinkingBudget(3, END, START, False))
    assert not ThinkingBudget(3, END, inside=False).applies  # nothing ever opens a block
    assert start_state(ThinkingBudget(3, END, inside=False), []) is None


def test_sampling_params_takes_only_a_thinking_budget() -> None:
    assert SamplingParams(thinking_budget=ThinkingBudget(2, END)).thinking_budget.budget == 2
    with pytest.raises(ValueError, match="^thinking_budget must be a ThinkingBudget"):
        SamplingParams(thinking_budget=5)  # type: ignore[arg-type]


# -- ThinkingState -------------------------------------------------------------------------


def _feed(state: ThinkingState, tokens: list[int]) -> list[int | None]:
    """Advances state over tokens; the forced id before each one and after the last."""
    seen = []
    for t in tokens:
        seen.append(state.forced)
        state.advance(t)
    return [*seen, state.forced]


def test_counts_then_forces_the_marker_one_id_at_a_time_then_done() -> None:
    state = ThinkingState(ThinkingBudget(3, END))
    assert state.phase is Phase.COUNTING
    assert _feed(state, FREE[:3]) == [None, None, None, END[0]]
    assert state.phase is Phase.FORCING and state.reasoning == 3
    assert _feed(state, list(END)) == [*END, None]
    assert state.done and state.reasoning == 3  # the forced ids are not reasoning
    assert _feed(state, FREE) == [None] * 6  # free from then on, markers included
    state.advance(30)
    assert state.done


def test_budget_zero_inside_forces_from_the_first_token() -> None:
    state = ThinkingState(ThinkingBudget(0, END))
    assert state.phase is Phase.FORCING and state.forced == END[0]


def test_a_natural_close_within_the_budget_ends_it() -> None:
    state = ThinkingState(ThinkingBudget(10, END))
    assert _feed(state, [*FREE[:2], *END]) == [None] * 8
    assert state.done and state.reasoning == 7
    assert start_state(ThinkingBudget(10, END), [*FREE[:2], *END, D]) is None


def test_a_marker_prefix_the_model_began_is_continued_not_repeated() -> None:
    state = ThinkingState(ThinkingBudget(4, END))
    _feed(state, [FREE[0], FREE[1], END[0], END[1]])  # "</th" as the 3rd and 4th tokens
    assert state.phase is Phase.FORCING and state.forced == END[2]
    assert _feed(state, list(END[2:])) == [*END[2:], None] and state.done


def test_not_inside_counting_starts_after_the_start_marker() -> None:
    spec = ThinkingBudget(2, END, start_ids=START, inside=False)
    state = ThinkingState(spec)
    assert state.phase is Phase.WAITING
    # Tokens before the start marker (and a partial start) are free and not counted; a marker
    # prefix just before the block is not continued either.
    assert _feed(state, [*FREE, *START[:3], *START]) == [None] * 14
    assert state.phase is Phase.COUNTING and state.reasoning == 0
    assert _feed(state, FREE[:2]) == [None, None, END[0]]
    # Budget 0: the marker right after the start marker.
    state = ThinkingState(ThinkingBudget(0, END, start_ids=(END[0],), inside=False))
    assert _feed(state, [FREE[0], END[0]]) == [None, None, END[0]]


def test_a_token_other_than_the_forced_id_forces_the_whole_marker_again() -> None:
    state = ThinkingState(ThinkingBudget(0, END))
    assert _feed(state, [END[0], END[1], D]) == [END[0], END[1], END[2], END[0]]


def test_replay_of_resumed_outputs_mid_forcing_continues_the_marker() -> None:
    spec = ThinkingBudget(3, END)
    state = start_state(spec, [*FREE[:3], END[0], END[1]])
    assert state is not None and state.forced == END[2] and state.reasoning == 3
    assert start_state(spec, [*FREE[:3], *END]) is None  # forced already: nothing left
    assert start_state(spec, []).forced is None


def test_host_bound_only_near_the_budget_and_while_forcing() -> None:
    state = ThinkingState(ThinkingBudget(5, END))
    bounds = [state.host_bound]
    for t in [*FREE, *END]:
        state.advance(t)
        bounds.append(state.host_bound)
    # reasoning 0..2 free of the host; 3, 4 near; forcing; done.
    assert bounds == [False, False, False, True, True, True, True, True, True, True, False]
    waiting = ThinkingState(ThinkingBudget(1, END, start_ids=START, inside=False))
    assert waiting.host_bound and not ThinkingState(ThinkingBudget(2, END, START, False)).host_bound


@pytest.mark.parametrize("budget", [0, 1, 2, 3, 7])
@pytest.mark.parametrize("inside", [True, False])
def test_masks_under_async_lag_equal_the_exact_ones(budget: int, inside: bool) -> None:
    """The engine's async loop: a step's mask comes from the state as it is at launch, which
    lags one token behind unless the step before it was host bound. Whatever the model
    writes, that mask is the one the exact state would give."""
    spec = ThinkingBudget(budget, END[:2], start_ids=START[:2], inside=inside)
    alphabet = [*FREE, *END[:2], *START[:2]]
    for seed in range(60):
        rng = random.Random(seed)
        state = ThinkingState(spec)
        in_flight: tuple[int, bool] | None = None  # (token, host bound at its launch)
        forced_seen = 0
        for _ in range(40):
            if in_flight is not None and in_flight[1]:
                state.advance(in_flight[0])
                in_flight = None
            exact = copy.deepcopy(state)
            if in_flight is not None:
                exact.advance(in_flight[0])
            assert state.forced == exact.forced, (seed, budget, inside)
            token = state.forced if state.forced is not None else rng.choice(alphabet)
            forced_seen += state.forced is not None
            bound = state.host_bound
            if in_flight is not None:
                state.advance(in_flight[0])
            in_flight = (token, bound)
    assert forced_seen or not inside


# -- mask rows and accept (StructuredDecoding) ---------------------------------------------


def _request(
    dec: StructuredDecoding,
    budget: ThinkingBudget | None,
    spec: StructuredOutputs | None = None,
    outputs: tuple[list[int], ...] = ([],),
) -> tuple[Request, list[tuple[Request, str]]]:
    """A request with one sample per `outputs` (earlier outputs: a resumed one), added and
    its grammar (if any) ready; returns it and the failures poll reported."""
    prompt = [5, 6, 7]
    params = SamplingParams(
        thinking_budget=budget, structured_outputs=spec, n=len(outputs), max_tokens=100
    )
    seqs = [
        Seq(f"r-{i}", "r", i, list(prompt), params, token_ids=[*prompt, *out])
        for i, out in enumerate(outputs)
    ]
    req = Request("r", None, list(prompt), params, seqs, arrival_time=0.0)
    dec.add(req)
    failed = list(dec._failed)
    dec._failed.clear()
    while dec._pending:
        dec.wait(5.0)
        failed += dec.poll()
    return req, failed


def _rows(dec: StructuredDecoding, *seqs: Seq) -> dict[str, set[int] | None]:
    """Each seq's allowed tokens this step (one decode each); None: no row (free)."""
    for s in seqs:
        s.num_computed_tokens = s.num_tokens - 1
    m = dec.bitmask([(s, 1) for s in seqs])
    got = {} if m is None else dict(zip(m.seq_ids, m.bits, strict=True))
    return {s.seq_id: _allowed(got[s.seq_id]) if s.seq_id in got else None for s in seqs}


def _allowed(row: np.ndarray) -> set[int]:
    bits = np.unpackbits(row.view(np.uint8), bitorder="little")
    return set(np.flatnonzero(bits).tolist())


def _sample(dec: StructuredDecoding, seq: Seq, token: int) -> bool:
    seq.token_ids.append(token)
    return dec.accept(seq, token)


def test_a_forcing_sequence_gets_a_one_hot_row_others_none(dec: StructuredDecoding) -> None:
    req, _ = _request(dec, ThinkingBudget(2, (31, 63, 1131)), outputs=([], []))
    a, b = req.seqs
    plain = Seq("p-0", "p", 0, [5], SamplingParams())
    assert _rows(dec, a, b, plain) == {a.seq_id: None, b.seq_id: None, plain.seq_id: None}
    for t in FREE[:2]:
        assert not _sample(dec, a, t)
    assert not _sample(dec, b, D)
    # Each sample has its own state: a forces, b (one token in) does not yet. Ids 31 and 63
    # are bit 31 of their word (a negative int32).
    assert _rows(dec, a, b, plain) == {a.seq_id: {31}, b.seq_id: None, plain.seq_id: None}
    assert a.thinking_bound and not _sample(dec, a, 31)
    assert _rows(dec, a)[a.seq_id] == {63}
    assert not _sample(dec, a, 63) and not _sample(dec, a, 1131)
    assert a.thinking is None and not a.thinking_bound and _rows(dec, a)[a.seq_id] is None


def test_the_forced_marker_wakes_a_grammar_waiting_for_it(dec: StructuredDecoding) -> None:
    spec = StructuredOutputs(regex=r"[0-9]-[0-9]").starting_after(END)
    req, failed = _request(dec, ThinkingBudget(1, END), spec)
    [seq] = req.seqs
    assert not failed and not seq.grammar_pending
    assert _rows(dec, seq)[seq.seq_id] is None and not _sample(dec, seq, DASH)
    for t in END:  # the dormant grammar leaves the row to the budget
        assert _rows(dec, seq)[seq.seq_id] == {t} and not _sample(dec, seq, t)
    assert seq.thinking is None and seq.grammar_after is None and seq.grammar.num_consumed == 0
    row = _rows(dec, seq)[seq.seq_id]
    assert D in row and DASH not in row and len(row) > 1  # the grammar's own mask
    assert not _sample(dec, seq, D) and not _sample(dec, seq, DASH) and _sample(dec, seq, D)


def test_a_natural_marker_wakes_the_grammar_and_ends_the_budget(dec: StructuredDecoding) -> None:
    spec = StructuredOutputs(regex=r"[0-9]").starting_after(END)
    req, _ = _request(dec, ThinkingBudget(100, END), spec)
    [seq] = req.seqs
    for t in [*FREE, *END]:
        assert _rows(dec, seq)[seq.seq_id] is None and not _sample(dec, seq, t)
    assert seq.thinking is None and seq.grammar_after is None
    assert DASH not in _rows(dec, seq)[seq.seq_id]


def test_an_active_grammar_wins_over_the_budget(dec: StructuredDecoding) -> None:
    req, _ = _request(dec, ThinkingBudget(0, END), StructuredOutputs(regex=r"[0-9]-[0-9]"))
    [seq] = req.seqs
    assert seq.thinking.forced == END[0]
    row = _rows(dec, seq)[seq.seq_id]
    assert D in row and END[0] not in row


def test_resumed_samples_replay_into_their_states(dec: StructuredDecoding) -> None:
    spec = StructuredOutputs(regex=r"[0-9]").starting_after(END)
    outputs = ([*FREE[:3], END[0], END[1]], [*FREE[:3], *END], [FREE[0]])
    req, failed = _request(dec, ThinkingBudget(3, END), spec, outputs)
    assert not failed
    mid, after, early = req.seqs
    rows = _rows(dec, mid, after, early)
    assert rows[mid.seq_id] == {END[2]} and rows[early.seq_id] is None
    assert D in rows[after.seq_id] and DASH not in rows[after.seq_id]  # the grammar's row
    assert after.thinking is None and after.grammar_after is None
    assert mid.thinking_bound and early.thinking.reasoning == 1
    for t in END[2:]:
        assert _rows(dec, mid)[mid.seq_id] == {t} and not _sample(dec, mid, t)
    assert mid.grammar_after is None and DASH not in _rows(dec, mid)[mid.seq_id]


def test_a_marker_id_outside_the_vocabulary_fails_the_request(
    dec: StructuredDecoding, tok: Tokenizer
) -> None:
    req, failed = _request(dec, ThinkingBudget(3, (5, tok.vocab_size)))
    assert [r for r, _ in failed] == [req] and "outside the vocabulary" in failed[0][1]
    assert all(s.grammar_pending and s.thinking is None for s in req.seqs)

"""Prompt lookup (workers/spec_decode/ngram.py)."""

from __future__ import annotations

from workers.spec_decode.ngram import NgramIndex


def test_the_tokens_after_the_latest_earlier_occurrence_of_the_longest_suffix() -> None:
    ix = NgramIndex(2, 4)
    tokens = [1, 2, 3, 4, 5, 6, 1, 2, 3]
    assert ix.propose(tokens, 4) == [4, 5, 6, 1]
    tokens.append(9)  # [2, 3, 9] never occurred; nor did [3, 9]
    assert ix.propose(tokens, 4) == []
    tokens += [1, 2, 3, 7, 1, 2, 3]
    # [1, 2, 3] occurred twice before: the latest (followed by 7) wins over the first.
    assert ix.propose(tokens, 2) == [7, 1]
    # A 4-gram match beats a shorter one: [9, 1, 2, 3] is followed by 7 too, [5, 6, 1, 2] by 3.
    assert NgramIndex(2, 4).propose([5, 6, 1, 2, 3, 8, 6, 1, 2, 3, 9, 5, 6, 1, 2], 1) == [3]


def test_no_proposal_below_the_minimum_length_or_past_the_end() -> None:
    assert NgramIndex(3, 4).propose([1, 2, 9, 1, 2], 3) == []  # only a 2-gram repeats
    assert NgramIndex(1, 1).propose([1, 2, 9, 1, 2], 3) == [9, 1, 2]
    assert NgramIndex(2, 2).propose([4, 4, 4], 5) == [4]  # what exists after the match


def test_inside_a_repeating_run_the_first_occurrence_gives_the_full_draft() -> None:
    # The latest [4, 4] ends one token before the end: it would give a draft of one token.
    assert NgramIndex(2, 2).propose([1, 4, 4, 4, 4, 4, 4], 3) == [4, 4, 4]
    assert NgramIndex(2, 2).propose([1, 2, 3, 1, 2, 3, 1, 2], 4) == [3, 1, 2, 3]

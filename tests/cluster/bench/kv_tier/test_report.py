"""The kv-tier report's arithmetic: percentiles, where pulling starts to win, and how often
the learned cost model picked the faster of pull and recompute."""

from __future__ import annotations

import math
from typing import Any

from cluster.bench.kv_tier.report import (
    crossover,
    percentile,
    picked_faster,
    picked_faster_overall,
    summarize,
    tables,
)


def test_percentile_interpolates_between_ranks() -> None:
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert percentile([1.0, 2.0], 50) == 1.5
    assert percentile([1.0, 2.0, 3.0, 4.0, 5.0], 99) == 4.96
    assert math.isnan(percentile([], 50))


def test_crossover_is_interpolated_or_said_plainly() -> None:
    at, text = crossover([1024, 2048, 4096], [1.5, 0.5, 0.2])
    assert at == 1536 and "1024 and 2048" in text
    assert crossover([1024, 2048], [0.9, 0.5]) == (
        None,
        "below the smallest measured length (1024 tokens)",
    )
    assert crossover([1024, 2048], [1.2, 1.1])[1] == "not within the measured lengths"
    assert crossover([1024, 2048], [math.nan, math.nan])[1] == "not measured"


def _s(ttft: float, outcome: str | None = None) -> dict[str, Any]:
    return {"ttft_s": ttft, "outcome": outcome, "pulled_blocks": 4}


def test_auto_picked_the_faster_arm_per_round() -> None:
    pull = [_s(0.02), _s(0.05), _s(0.02), _s(0.03)]
    recompute = [_s(0.04), _s(0.03), _s(0.04), _s(0.03)]
    # Round 0: pull faster, auto pulled (right). Round 1: recompute faster, auto pulled
    # (wrong). Round 2: pull faster, auto recomputed (wrong: a miss computes too). Round 3:
    # a tie, counted apart.
    auto = [_s(0.02, "pulled"), _s(0.05, "pulled"), _s(0.04, "miss"), _s(0.03, "recompute")]
    got = picked_faster(pull, recompute, auto)
    assert got == {"right": 1, "rounds": 3, "share": 1 / 3, "ties": 1}
    # Within 10 % of each other: a tie, whatever auto chose.
    assert picked_faster([_s(0.0105)], [_s(0.0100)], [_s(0.0105, "pulled")])["ties"] == 1
    assert picked_faster([_s(0.0115)], [_s(0.0100)], [_s(0.0115, "pulled")])["right"] == 0
    # A round without a TTFT is left out; recompute faster and auto recomputed: right.
    got = picked_faster([_s(0.05), {"ttft_s": None}], [_s(0.03)] * 2, [_s(0.03, "recompute")] * 2)
    assert got == {"right": 1, "rounds": 1, "share": 1.0, "ties": 0}
    assert math.isnan(picked_faster([], [], [])["share"])


def test_summary_and_tables_say_how_often_auto_was_right() -> None:
    wrong = {
        "pull": [_s(0.05)],
        "recompute": [_s(0.03)],
        "auto": [{**_s(0.05, "pulled"), "est_pull_s": 0.001, "est_compute_s": 0.2}],
    }
    right = {
        "pull": [_s(0.02), _s(0.02)],
        "recompute": [_s(0.04), _s(0.04)],
        "auto": [_s(0.02, "pulled"), _s(0.02, "pulled")],
    }
    summary = summarize({256: wrong, 1024: right})
    assert summary["256"]["auto_picked_faster"] == {
        "right": 0, "rounds": 1, "share": 0.0, "ties": 0
    }  # fmt: skip
    assert summary["1024"]["auto_picked_faster"]["right"] == 2
    assert picked_faster_overall(summary) == {"right": 2, "rounds": 3, "share": 2 / 3, "ties": 0}
    text = tables(summary)
    assert "0 of 1 (0 %)" in text and "2 of 2 (100 %)" in text
    assert "in 2 of 3 (67 %) rounds" in text
    assert "1.0 / 50.0" in text and "200.0 / 30.0" in text  # estimates beside the medians

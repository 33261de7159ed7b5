"""The kv-tier report's arithmetic: percentiles and where pulling starts to win."""

from __future__ import annotations

import math

from cluster.bench.kv_tier.report import crossover, percentile


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

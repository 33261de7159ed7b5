"""Exported counters following the engine's cumulative counts (cluster/replica/cumulative.py)."""

from __future__ import annotations

from cluster.replica.cumulative import CumulativeCounters, increase


class _Counter:
    def __init__(self) -> None:
        self.value = 0.0

    def inc(self, delta: float) -> None:
        assert delta > 0
        self.value += delta


def test_a_counter_advances_by_the_difference_and_starts_over_after_a_rebuild() -> None:
    assert increase(7, 3) == 4 and increase(3, 3) == 0 and increase(2, 9) == 2
    counters, c = CumulativeCounters(), _Counter()
    for cumulative in (3, 3, 10, 4, 6):  # the engine was rebuilt before the 4
        counters.advance(c, "n", cumulative)
    assert c.value == 3 + 7 + 4 + 2 and counters.last == {"n": 6}

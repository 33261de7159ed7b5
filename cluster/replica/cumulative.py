"""Exported counters that follow the engine's cumulative counts (EngineStats' counters).

A snapshot carries each count since the engine started; the exported counter advances by the
difference from the previous snapshot. A count smaller than the previous one means the engine
was rebuilt (restarted in place) and counts from 0 again: all of it is new.
"""

from __future__ import annotations

from typing import Any


def increase(cumulative: float, last: float) -> float:
    """What a cumulative count added since it was `last` (module doc)."""
    return cumulative - last if cumulative >= last else cumulative


class CumulativeCounters:
    """The counts seen at the previous snapshot, by key; `advance` moves a counter on."""

    def __init__(self) -> None:
        self.last: dict[str, float] = {}

    def advance(self, counter: Any, key: str, cumulative: float) -> None:
        delta = increase(cumulative, self.last.get(key, 0))
        self.last[key] = cumulative
        if delta > 0:
            counter.inc(delta)

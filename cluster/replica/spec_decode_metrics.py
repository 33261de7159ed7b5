"""Prometheus metrics of an engine's speculative decoding (part of EngineMetrics, metrics.py),
from EngineStats' `spec_decode_*` fields (workers/core/speculator.py; zeros when off).

Counters with vLLM's meanings, advanced by the difference of the engine's cumulative counts as
EngineMetrics does: drafts (a sequence's draft verified in a step), draft tokens proposed and
draft tokens accepted. Acceptance rate = accepted / draft tokens; mean accepted length per
draft = 1 + accepted / drafts (the token every verifying step yields besides its draft).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from cluster.ray_internals import record_zero
from cluster.replica.cumulative import CumulativeCounters

if TYPE_CHECKING:
    from workers.core.stats import EngineStats

# (EngineStats field, metric name, help).
COUNTERS = (
    (
        "spec_decode_drafts",
        "kvray_spec_decode_drafts_total",
        "Speculative drafts verified (one per sequence per step that carried one).",
    ),
    (
        "spec_decode_draft_tokens",
        "kvray_spec_decode_draft_tokens_total",
        "Draft tokens proposed and verified.",
    ),
    (
        "spec_decode_accepted_tokens",
        "kvray_spec_decode_accepted_tokens_total",
        "Draft tokens the model accepted.",
    ),
)


class SpecDecodeMetrics:
    """Made by EngineMetrics with its metric constructors (same `model`, `replica` labels)."""

    def __init__(self, tags: dict[str, str], counter: Any) -> None:
        self._counters = [(field, counter(name, doc)) for field, name, doc in COUNTERS]
        for _, c in self._counters:
            record_zero(c, tags)
        self._cumulative = CumulativeCounters()

    def observe(self, stats: EngineStats) -> None:
        for field, c in self._counters:
            self._cumulative.advance(c, field, int(getattr(stats, field)))

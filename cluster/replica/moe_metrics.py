"""Prometheus metrics of a mixture-of-experts engine: which experts are hot (part of
EngineMetrics, metrics.py), from EngineStats.moe_expert_tokens.

- `kvray_moe_expert_tokens_total{expert}`: tokens routed to each expert index, summed over the
  sparse layers (a token counts once per expert of its top-k). Summing over layers keeps the
  series to one per expert, and it is the figure expert parallelism balances: a rank holds the
  same expert indices in every layer (workers/device/layers/moe.py ExpertPartition), so the
  sum over its experts is that rank's share of the expert work.
- `kvray_moe_expert_load_imbalance_ratio`: over the tokens routed since the previous snapshot,
  each layer's busiest expert's tokens over the mean per expert, averaged over the layers:
  1 when every expert gets the same, `num_experts / top_k` at worst. Left as it was when no
  token was routed in between.

Dense models export neither (their EngineStats carry no expert counts).
"""

from __future__ import annotations

from typing import Any

from cluster.ray_internals import record_zero
from cluster.replica.cumulative import increase


class MoeMetrics:
    """Made by EngineMetrics with its metric constructors (same `model`, `replica` labels)."""

    def __init__(self, tags: dict[str, str], counter: Any, gauge: Any) -> None:
        self._tags = tags
        self._tokens = counter(
            "kvray_moe_expert_tokens_total",
            "Tokens routed to each expert (index), summed over the MoE layers.",
            ("expert",),
        )
        self._imbalance = gauge(
            "kvray_moe_expert_load_imbalance_ratio",
            "Busiest expert's tokens over the mean per expert, averaged over the MoE layers "
            "(1 = balanced), since the previous snapshot.",
        )
        self._last: list[list[int]] | None = None  # the previous snapshot's counts
        self._ratio: float | None = None  # the latest imbalance, set again every snapshot

    def observe(self, counts: tuple[tuple[int, ...], ...]) -> None:
        if not counts:
            return
        rows = [list(r) for r in counts]
        last = self._last
        if last is None or len(last) != len(rows) or len(last[0]) != len(rows[0]):
            for e in range(len(rows[0])):
                record_zero(self._tokens, {**self._tags, "expert": str(e)})
            last = [[0] * len(rows[0]) for _ in rows]
        deltas = [
            [increase(c, p) for c, p in zip(row, prev, strict=True)]
            for row, prev in zip(rows, last, strict=True)
        ]
        self._last = rows
        per_expert = [sum(col) for col in zip(*deltas, strict=True)]
        for e, n in enumerate(per_expert):
            if n > 0:
                self._tokens.inc(n, tags={"expert": str(e)})
        ratios = [max(d) * len(d) / sum(d) for d in deltas if sum(d) > 0]
        if ratios:
            self._ratio = sum(ratios) / len(ratios)
        if self._ratio is not None:
            # Every snapshot: Ray's metrics agent drops a gauge not reported for two intervals.
            self._imbalance.set(self._ratio)

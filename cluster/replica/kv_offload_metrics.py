"""Prometheus metrics of an engine's host KV tier (part of EngineMetrics, metrics.py), from
EngineStats' `kv_offload_*` fields (workers/core/host_tier.py; zeros with the tier off).

Gauges: blocks and bytes the tier holds (over all the engine's ranks) and the bytes it may
hold. Counters, advanced by the difference of the engine's cumulative counts as EngineMetrics
does: prompt tokens restored from the tier instead of computed (next to
`kvray_prefix_cache_hits_total`, the device cache's), blocks copied out and back in, and
blocks dropped to make room.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from cluster.ray_internals import record_zero
from cluster.replica.cumulative import CumulativeCounters

if TYPE_CHECKING:
    from workers.core.stats import EngineStats

# (EngineStats field, metric name, help) of the counters.
COUNTERS = (
    (
        "kv_offload_hit_tokens",
        "kvray_kv_offload_hit_tokens_total",
        "Prompt tokens restored from the host KV tier instead of computed.",
    ),
    (
        "kv_offload_copies_out",
        "kvray_kv_offload_copies_out_total",
        "KV blocks copied from the device to the host tier.",
    ),
    (
        "kv_offload_copies_in",
        "kvray_kv_offload_copies_in_total",
        "KV blocks copied from the host tier back to the device.",
    ),
    (
        "kv_offload_evictions",
        "kvray_kv_offload_evictions_total",
        "KV blocks dropped from the host tier to make room.",
    ),
)


class KvOffloadMetrics:
    """Made by EngineMetrics with its metric constructors (same `model`, `replica` labels)."""

    def __init__(self, tags: dict[str, str], counter: Any, gauge: Any) -> None:
        self._blocks = gauge("kvray_kv_offload_blocks", "KV blocks in the host tier.")
        self._bytes = gauge("kvray_kv_offload_bytes", "Bytes of KV blocks in the host tier.")
        self._capacity = gauge(
            "kvray_kv_offload_capacity_bytes", "Bytes the host KV tier may hold (0: off)."
        )
        self._counters = [(field, counter(name, doc)) for field, name, doc in COUNTERS]
        for _, c in self._counters:
            record_zero(c, tags)
        self._cumulative = CumulativeCounters()

    def observe(self, stats: EngineStats) -> None:
        # Every snapshot: Ray's metrics agent drops a gauge not reported for two intervals.
        self._blocks.set(int(stats.kv_offload_blocks))
        self._bytes.set(int(stats.kv_offload_bytes))
        self._capacity.set(int(stats.kv_offload_capacity_bytes))
        for field, c in self._counters:
            self._cumulative.advance(c, field, int(getattr(stats, field)))

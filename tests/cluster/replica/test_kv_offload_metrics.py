"""The engine replica's host KV tier metrics (cluster/replica/kv_offload_metrics.py), through
Ray's real export: gauges as the last snapshot, counters advanced by EngineStats' deltas."""

from __future__ import annotations

from typing import Any

from tests.cluster.replica.test_metrics import (  # noqa: F401 - pytest fixtures
    exporter,
    metrics_url,
    until_values,
)
from workers.core.stats import EngineStats


def _snap(blocks: int, hits: int, out: int, back: int, dropped: int) -> EngineStats:
    return EngineStats(
        kv_offload_blocks=blocks,
        kv_offload_bytes=blocks * 1024,
        kv_offload_capacity_bytes=8 * 1024,
        kv_offload_hit_tokens=hits,
        kv_offload_copies_out=out,
        kv_offload_copies_in=back,
        kv_offload_evictions=dropped,
    )


def test_tier_gauges_and_counters(exporter: Any) -> None:  # noqa: F811
    host, url = exporter
    names = ("hit_tokens", "copies_out", "copies_in", "evictions")
    until_values(
        url,
        host,
        [(f"kvray_kv_offload_{n}_total", {}, 0) for n in names],
        "zero-initialised host-tier counters",
    )
    # The engine was rebuilt before the last snapshot: its counts restart from 0.
    for snap in (_snap(3, 32, 5, 2, 0), _snap(8, 96, 12, 6, 4), _snap(2, 16, 2, 1, 0)):
        host.call("engine", "observe_stats", snap)
    until_values(
        url,
        host,
        [
            ("kvray_kv_offload_blocks", {}, 2),
            ("kvray_kv_offload_bytes", {}, 2048),
            ("kvray_kv_offload_capacity_bytes", {}, 8192),
            ("kvray_kv_offload_hit_tokens_total", {}, 96 + 16),
            ("kvray_kv_offload_copies_out_total", {}, 12 + 2),
            ("kvray_kv_offload_copies_in_total", {}, 6 + 1),
            ("kvray_kv_offload_evictions_total", {}, 4),
        ],
        "host-tier gauges and counters",
    )

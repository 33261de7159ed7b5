"""The engine replica's speculative decoding metrics (cluster/replica/spec_decode_metrics.py),
through Ray's real export: counters advanced by EngineStats' deltas."""

from __future__ import annotations

from typing import Any

from tests.cluster.replica.test_metrics import (  # noqa: F401 - pytest fixtures
    exporter,
    metrics_url,
    until_values,
)
from workers.core.stats import EngineStats


def _snap(drafts: int, proposed: int, accepted: int) -> EngineStats:
    return EngineStats(
        spec_decode_drafts=drafts,
        spec_decode_draft_tokens=proposed,
        spec_decode_accepted_tokens=accepted,
    )


def test_spec_decode_counters(exporter: Any) -> None:  # noqa: F811
    host, url = exporter
    names = ("drafts", "draft_tokens", "accepted_tokens")
    until_values(
        url,
        host,
        [(f"kvray_spec_decode_{n}_total", {}, 0) for n in names],
        "zero-initialised speculative decoding counters",
    )
    # The engine was rebuilt before the last snapshot: its counts restart from 0.
    for snap in (_snap(3, 12, 7), _snap(10, 40, 25), _snap(2, 8, 8)):
        host.call("engine", "observe_stats", snap)
    until_values(
        url,
        host,
        [
            ("kvray_spec_decode_drafts_total", {}, 10 + 2),
            ("kvray_spec_decode_draft_tokens_total", {}, 40 + 8),
            ("kvray_spec_decode_accepted_tokens_total", {}, 25 + 8),
        ],
        "speculative decoding counters",
    )

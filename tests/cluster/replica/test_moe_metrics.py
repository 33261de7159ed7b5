"""The engine replica's mixture-of-experts metrics (cluster/replica/moe_metrics.py), exported
for real through Ray's agent: tokens per expert summed over layers, and the imbalance gauge."""

from __future__ import annotations

from typing import Any

from tests.cluster.replica.test_metrics import (  # noqa: F401 - pytest fixtures
    exporter,
    metrics_url,
    until_values,
)
from workers.core.stats import EngineStats


def test_tokens_per_expert_and_imbalance(exporter: Any) -> None:  # noqa: F811
    host, url = exporter
    snapshots = [
        # Two sparse layers, four experts: cumulative counts.
        ((4, 0, 2, 2), (1, 1, 3, 3)),
        ((8, 0, 2, 6), (1, 5, 3, 7)),  # deltas (4, 0, 0, 4) and (0, 4, 0, 4)
    ]
    for counts in snapshots:
        host.call("engine", "observe_stats", EngineStats(moe_expert_tokens=counts))
    until_values(
        url,
        host,
        [
            ("kvray_moe_expert_tokens_total", {"expert": "0"}, 9),
            ("kvray_moe_expert_tokens_total", {"expert": "1"}, 5),
            ("kvray_moe_expert_tokens_total", {"expert": "2"}, 5),
            ("kvray_moe_expert_tokens_total", {"expert": "3"}, 13),
            # The last interval: each layer's busiest expert got 4 of 8 tokens, mean 2: 2.0.
            ("kvray_moe_expert_load_imbalance_ratio", {}, 2.0),
        ],
        "tokens per expert",
    )

"""`kvray_engine_info{model, replica, cpu_kernels}`: 1 per replica, what its engine runs in the
labels (the CPU kernels' state from EngineStats.cpu_kernels), through Ray's metrics agent."""

from __future__ import annotations

from typing import Any

from tests.cluster.replica.test_metrics import (  # noqa: F401 - pytest fixtures
    exporter,
    metrics_url,
    until_values,
)
from workers.core.stats import EngineStats


def test_engine_info_carries_the_cpu_kernels_label(exporter: Any) -> None:  # noqa: F811
    host, url = exporter
    host.call("engine", "observe_stats", EngineStats(cpu_kernels="on (AVX-512)"))
    until_values(
        url,
        host,
        [("kvray_engine_info", {"cpu_kernels": "on (AVX-512)"}, 1)],
        "the info gauge with the kernels' state",
    )
    # The same state again changes nothing; a rebuilt engine that runs otherwise moves the 1.
    host.call("engine", "observe_stats", EngineStats(cpu_kernels="on (AVX-512)"))
    host.call("engine", "observe_stats", EngineStats(cpu_kernels="off: disabled by config"))
    until_values(
        url,
        host,
        [
            ("kvray_engine_info", {"cpu_kernels": "off: disabled by config"}, 1),
            ("kvray_engine_info", {"cpu_kernels": "on (AVX-512)"}, 0),
        ],
        "the info gauge after the engine's state changed",
    )

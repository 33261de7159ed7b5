"""The engine replica's LoRA metrics (cluster/replica/lora_metrics.py): the bounded `lora`
label, and the real export through Ray's agent (per-adapter requests, tokens and TTFT; slots,
loads, evictions and load seconds from EngineStats deltas)."""

from __future__ import annotations

from typing import Any

from cluster.replica.lora_metrics import BASE_LABEL, MAX_LORA_LABELS, OTHER_LABEL, LoraLabels
from tests.cluster.replica.test_metrics import (  # noqa: F401 - pytest fixtures
    exporter,
    finished,
    metrics_url,
    until_values,
)
from workers.core.stats import EngineStats
from workers.lora.request import LoRARequest


def _lora(name: str, i: int = 1) -> LoRARequest:
    return LoRARequest(name, i, f"/adapters/{name}")


def test_the_first_adapters_keep_their_names_later_ones_are_other() -> None:
    labels = LoraLabels()
    names = [f"a{i}" for i in range(MAX_LORA_LABELS + 3)]
    got = [labels(_lora(n, i + 1)) for i, n in enumerate(names)]
    assert got == names[:MAX_LORA_LABELS] + [OTHER_LABEL] * 3
    # A named adapter keeps its name; the base model is never an adapter, nor counted as one.
    assert labels(_lora("a0")) == "a0" and labels(None) == BASE_LABEL
    assert labels(_lora(names[-1])) == OTHER_LABEL
    fresh = LoraLabels(limit=1)
    assert [fresh(None), fresh(_lora("x")), fresh(None), fresh(_lora("y"))] == [
        "",
        "x",
        "",
        "other",
    ]


def test_per_adapter_requests_tokens_and_ttft(exporter: Any) -> None:  # noqa: F811
    host, url = exporter
    host.call("engine", "observe_finished", finished(7, [4], ["stop"], 10.0, 0.05, []), _lora("a"))
    host.call(
        "engine", "observe_finished", finished(9, [2, 3], ["stop"] * 2, 20.0, 2.5, []), _lora("a")
    )
    host.call("engine", "observe_finished", finished(5, [1], ["length"], 30.0, 0.01, []), None)
    host.call("engine", "observe_aborted", _lora("b", 2))
    ttft = "kvray_lora_time_to_first_token_seconds"
    until_values(
        url,
        host,
        [
            ("kvray_lora_requests_total", {"lora": "a"}, 2),
            ("kvray_lora_requests_total", {"lora": "b"}, 1),  # aborted, no output
            ("kvray_lora_prompt_tokens_total", {"lora": "a"}, 7 + 9),
            ("kvray_lora_generation_tokens_total", {"lora": "a"}, 4 + 2 + 3),
            (f"{ttft}_count", {"lora": "a"}, 2),
            (f"{ttft}_bucket", {"lora": "a", "le": "0.06"}, 1),
            (f"{ttft}_bucket", {"lora": "a", "le": "3.0"}, 2),
            # The engine-wide metrics still count every request.
            ("kvray_prompt_tokens_total", {}, 7 + 9 + 5),
        ],
        "per-adapter series",
    )
    # Base-model requests: lora="" (Prometheus: no lora label), next to the adapters.
    s = until_values(url, host, [(f"{ttft}_count", {}, 3)], "every request's TTFT")
    base = [
        x
        for x in s.find(f"ray_{ttft}_count", replica=host.replica)
        if x.labels.get("lora", "") == ""
    ]
    assert sum(x.value for x in base) == 1


def test_slots_loads_evictions_and_load_seconds(exporter: Any) -> None:  # noqa: F811
    host, url = exporter
    until_values(
        url,
        host,
        [(f"kvray_lora_{n}_total", {}, 0) for n in ("loads", "evictions", "load_seconds")],
        "zero-initialised adapter counters",
    )
    snapshots = [
        EngineStats(lora_adapters=(3, 1), lora_slots_used=2, lora_slots_total=4, lora_loads=3,
                    lora_evictions=0, lora_load_seconds=0.25),
        EngineStats(lora_adapters=(1, 3, 5, 6), lora_slots_used=4, lora_slots_total=4,
                    lora_loads=7, lora_evictions=2, lora_load_seconds=1.0),
        # The engine was rebuilt: its cumulative counts restart from 0.
        EngineStats(lora_adapters=(9,), lora_slots_used=1, lora_slots_total=4, lora_loads=1,
                    lora_evictions=0, lora_load_seconds=0.5),
    ]  # fmt: skip
    for snap in snapshots:
        host.call("engine", "observe_stats", snap)
    until_values(
        url,
        host,
        [
            ("kvray_lora_slots_used", {}, 1),
            ("kvray_lora_slots", {}, 4),
            ("kvray_lora_loads_total", {}, 8),
            ("kvray_lora_evictions_total", {}, 2),
            ("kvray_lora_load_seconds_total", {}, 1.5),
        ],
        "adapter slots and loads",
    )

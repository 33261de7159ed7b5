"""`kvray bench serve` statistics and report: summaries, per-round comparisons."""

from __future__ import annotations

import pytest

from cluster.bench.common.backend_types import RequestRecord
from cluster.bench.serve.report import compare, format_report, summarize


def test_summary_statistics() -> None:
    recs = [
        RequestRecord(True, 10, 5, ttft=0.1, itl=[0.01] * 4, e2e=0.14, cached_tokens=4),
        RequestRecord(True, 10, 5, ttft=0.3, itl=[0.03] * 4, e2e=0.42, cached_tokens=0),
        RequestRecord(False, 10, error="HTTP 429: busy"),
    ]
    s = summarize("x", recs, elapsed=2.0)
    assert (s["completed"], s["failed"], s["errors"]) == (2, 1, ["HTTP 429: busy"])
    assert s["output_throughput"] == 5.0 and s["request_throughput"] == 1.0
    assert s["ttft_ms"]["median"] == pytest.approx(200.0) and s["ttft_ms"]["p99"] == 300.0
    assert s["tpot_ms"]["mean"] == pytest.approx((10 + 30) / 2)
    assert s["prefix_cache_hit_rate"] == pytest.approx(4 / 20)


def _run(backend: str, round_: int, tok_s: float, ttft_ms: float, group: str = "") -> dict:
    return {
        "backend": backend,
        "round": round_,
        "group": group,
        "output_throughput": tok_s,
        "ttft_ms": {"median": ttft_ms},
        "prefix_cache_hit_rate": 0.0,
    }


def test_compare_takes_each_rounds_own_baseline_and_the_median() -> None:
    runs = [
        _run("inprocess", 0, 100, 50), _run("http", 0, 50, 80),
        _run("inprocess", 1, 200, 40), _run("http", 1, 180, 45),
        _run("inprocess", 2, 100, 50), _run("http", 2, 90, 70),
    ]  # fmt: skip
    c = compare(runs)["http vs inprocess"]
    assert c["output_throughput_ratios"] == [0.5, 0.9, 0.9]
    assert c["output_throughput_ratio"] == 0.9 and c["median_ttft_overhead_ms"] == 20
    assert "median of 3 rounds, 0.50-0.90x" in format_report(
        [{**r, "request_throughput": 1, "ttft_ms": {"mean": 1, "median": 1, "p99": 1},
          "tpot_ms": {"median": 1}, "itl_ms": {"median": 1, "p99": 1},
          "e2e_ms": {"median": 1, "p99": 1}} for r in runs],
        {"http vs inprocess": c},
    )  # fmt: skip

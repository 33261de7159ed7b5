"""`kvray bench serve`: workloads, statistics, and one small real run (http + inprocess)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from cluster.bench import serve as bench_serve
from cluster.bench.backends import RequestRecord
from tests.cluster.serve_helpers import KV_CACHE_BYTES, App


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    bench_serve.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_tenant_workload_shares_prefixes_per_tenant() -> None:
    w = bench_serve.tenant_workload(
        range(100, 200), num_prompts=40, num_tenants=3, prefix_len=32, input_len=48,
        output_len=5, seed=1,
    )  # fmt: skip
    assert len(w.requests) == 40 and all(r.prompt_len == 48 for r in w.requests)
    prefixes = {r.prompt_ids[:32] for r in w.requests}
    assert len(prefixes) == 3
    again = bench_serve.tenant_workload(
        range(100, 200), num_prompts=40, num_tenants=3, prefix_len=32, input_len=48,
        output_len=5, seed=1,
    )  # fmt: skip
    assert again == w
    with pytest.raises(ValueError):
        bench_serve.tenant_workload(
            [1], num_prompts=1, num_tenants=1, prefix_len=8, input_len=8, output_len=1, seed=0
        )


def test_summary_statistics() -> None:
    recs = [
        RequestRecord(True, 10, 5, ttft=0.1, itl=[0.01] * 4, e2e=0.14, cached_tokens=4),
        RequestRecord(True, 10, 5, ttft=0.3, itl=[0.03] * 4, e2e=0.42, cached_tokens=0),
        RequestRecord(False, 10, error="HTTP 429: busy"),
    ]
    s = bench_serve.summarize("x", recs, elapsed=2.0)
    assert (s["completed"], s["failed"], s["errors"]) == (2, 1, ["HTTP 429: busy"])
    assert s["output_throughput"] == 5.0 and s["request_throughput"] == 1.0
    assert s["ttft_ms"]["median"] == pytest.approx(200.0) and s["ttft_ms"]["p99"] == 300.0
    assert s["tpot_ms"]["mean"] == pytest.approx((10 + 30) / 2)
    assert s["prefix_cache_hit_rate"] == pytest.approx(4 / 20)


@pytest.mark.slow
def test_small_run_against_the_server_and_inprocess(kvray_app: App, tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    args = _args(
        "--backend", "inprocess,http", "--base-url", kvray_app.base_url,
        "--api-key", kvray_app.api_key, "--num-prompts", "8", "--input-len", "40",
        "--output-len", "6", "--max-concurrency", "4", "--kv-cache-memory", str(KV_CACHE_BYTES),
        "--warmup-requests", "1", "--rounds", "2", "--result-json", str(out),
    )  # fmt: skip
    assert bench_serve.run(args) == 0
    result = json.loads(out.read_text())
    runs = {(r["backend"], r["round"]): r for r in result["runs"]}
    assert list(runs) == [("inprocess", 0), ("http", 0), ("inprocess", 1), ("http", 1)]
    for r in runs.values():
        assert r["completed"] == 8 and r["output_tokens"] == 8 * 6
        assert r["ttft_ms"]["median"] > 0 and r["e2e_ms"]["p99"] >= r["e2e_ms"]["median"]
    # Each round has its own prompts: the second is not served from the first's cache.
    assert runs[("http", 1)]["prefix_cache_hit_rate"] == 0.0
    assert result["comparisons"]["http vs inprocess"]["rounds"] == 2
    # The in-process engine runs in this (the client) process.
    assert runs[("inprocess", 0)]["cpu_ms_per_output_token"]["client"] > 0


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
    c = bench_serve.compare(runs)["http vs inprocess"]
    assert c["output_throughput_ratios"] == [0.5, 0.9, 0.9]
    assert c["output_throughput_ratio"] == 0.9 and c["median_ttft_overhead_ms"] == 20
    assert "median of 3 rounds, 0.50-0.90x" in bench_serve.format_report(
        [{**r, "request_throughput": 1, "ttft_ms": {"mean": 1, "median": 1, "p99": 1},
          "tpot_ms": {"median": 1}, "itl_ms": {"median": 1, "p99": 1},
          "e2e_ms": {"median": 1, "p99": 1}} for r in runs],
        {"http vs inprocess": c},
    )  # fmt: skip

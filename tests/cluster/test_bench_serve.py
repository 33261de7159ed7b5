"""`kvray bench serve`: workloads, statistics, and one small real run (http + inprocess)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from cluster import bench_serve
from cluster.bench_serve_backends import RequestRecord
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
        "--warmup-requests", "1", "--result-json", str(out),
    )  # fmt: skip
    assert bench_serve.run(args) == 0
    result = json.loads(out.read_text())
    runs = {r["backend"]: r for r in result["runs"]}
    assert set(runs) == {"inprocess", "http"}
    for r in runs.values():
        assert r["completed"] == 8 and r["output_tokens"] == 8 * 6
        assert r["ttft_ms"]["median"] > 0 and r["e2e_ms"]["p99"] >= r["e2e_ms"]["median"]
    assert "http vs inprocess" in result["comparisons"]

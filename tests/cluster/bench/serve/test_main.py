"""`kvray bench serve`: one small real run (http + inprocess) against the session's server."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from cluster.bench.serve import main as bench_serve
from cluster.bench.serve.structured import MAX_TOKENS
from tests.cluster.serve_helpers import KV_CACHE_BYTES, App, ServePorts


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    bench_serve.add_arguments(parser)
    return parser.parse_args(list(argv))


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


@pytest.mark.slow
def test_json_schema_workload_over_every_backend(
    kvray_app: App, serve_ports: ServePorts, tmp_path: Path
) -> None:
    out = tmp_path / "bench.json"
    args = _args(
        "--backend", "inprocess,http,grpc", "--base-url", kvray_app.base_url,
        "--grpc-address", f"127.0.0.1:{serve_ports.grpc}", "--api-key", kvray_app.api_key,
        "--workload", "json-schema", "--num-prompts", "4", "--input-len", "16",
        "--max-concurrency", "4", "--kv-cache-memory", str(KV_CACHE_BYTES),
        "--warmup-requests", "1", "--result-json", str(out),
    )  # fmt: skip
    assert bench_serve.run(args) == 0
    result = json.loads(out.read_text())
    runs = {r["backend"]: r for r in result["runs"]}
    for backend in ("inprocess", "http", "grpc"):
        c, u = runs[f"{backend} json-schema"], runs[f"{backend} unconstrained"]
        assert c["completed"] == u["completed"] == 4, (c["errors"], u["errors"])
        # The grammar ended some constrained outputs before the cap; each twin ran as long.
        assert c["finished_by_grammar"] > 0
        assert u["output_tokens"] == c["output_tokens"] < 4 * MAX_TOKENS
        assert u["prefix_cache_hit_rate"] == 0.0
    compared = result["comparisons"]["json_schema_vs_unconstrained"]
    assert set(compared) == {"inprocess", "http", "grpc"}
    assert all(c["output_throughput_ratio"] > 0 for c in compared.values())

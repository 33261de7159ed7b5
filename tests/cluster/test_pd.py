"""Prefill/decode disaggregation end to end: an application with one prefill and one decode
replica (`--prefill-replicas 1 --pd always`) serves greedy and seeded requests, streamed and
not, over HTTP. Each must equal the offline engine's text with exact usage; the prefill
replica must have published the prompts' blocks and the decode replica pulled them (it never
computed a handed-off prompt); afterwards neither holds a KV block. With the prefill
replica's engine killed, requests fall back to the decode replica and are still exact.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from cluster.config import ServeConfig
from cluster.deploy.app import PREFILL_SERVER_NAME
from tests.cluster.migration_load import (
    LoadRequest,
    build_load,
    expected_texts,
    failures,
    kill_pid,
    start_load,
)
from tests.cluster.serve_helpers import (
    KV_CACHE_BYTES,
    App,
    ServePorts,
    deploy,
    wait_for,
    wait_until_idle,
)

pytestmark = pytest.mark.slow

# 6 full blocks of the demo's 16-token blocks, and some tokens past them.
PROMPT_LEN = 100


@pytest.fixture(scope="module")
def app(serve_ports: ServePorts) -> Iterator[App]:
    from ray import serve

    config = ServeConfig.from_flat(
        num_replicas=1,
        prefill_replicas=1,
        pd="always",
        kv_cache_memory_bytes=KV_CACHE_BYTES,
        kv_offload_gib=0.05,
        kv_share_gib=0.1,
        api_key_env="KVRAY_PD_NO_KEY",  # unset on the cluster: no key required
    )
    app = deploy("pd", "/pd", config, serve_ports, None)
    try:
        yield app
    finally:
        serve.delete(app.name)


def _load(seed: int) -> list[LoadRequest]:
    return build_load(
        seed, count=12, prompt_len=PROMPT_LEN, min_tokens=16, max_tokens=48,
        vias=("http_stream", "http"),
    )  # fmt: skip


def _prefill_stats(app: App) -> dict[str, Any]:
    return app.handle(PREFILL_SERVER_NAME).replica_stats.remote().result()


def _decode_stats(app: App) -> dict[str, Any]:
    return app.handle().replica_stats.remote().result()


def test_disaggregated_requests_equal_the_offline_engine(
    app: App, serve_ports: ServePorts, demo_dir: Path
) -> None:
    requests = _load(seed=44)
    want = expected_texts(demo_dir, requests)
    before = _decode_stats(app)["kv_share"]
    results = start_load(app, serve_ports.grpc, requests).wait()
    assert failures(results, want) == []
    after = _decode_stats(app)["kv_share"]
    # Every request was handed off, and its decode replica pulled the prompt's blocks.
    assert after["pulled"] - before["pulled"] == len(requests)
    assert after["pulled_blocks"] - before["pulled_blocks"] >= len(requests) * (PROMPT_LEN // 16)
    assert _prefill_stats(app)["kv_share"]["published"] >= len(requests) * (PROMPT_LEN // 16)
    _assert_idle(app)


def test_a_dead_prefill_engine_falls_back_to_the_decode_replica(
    app: App, serve_ports: ServePorts, demo_dir: Path
) -> None:
    requests = _load(seed=45)
    want = expected_texts(demo_dir, requests)
    stats = _prefill_stats(app)
    kill_pid(stats["engine_pid"])  # the prefill replica restarts its engine meanwhile
    results = start_load(app, serve_ports.grpc, requests).wait()
    assert failures(results, want) == []
    wait_for(lambda: _prefill_stats(app)["engine_pid"] != stats["engine_pid"], "the restart")
    _assert_idle(app)


def _assert_idle(app: App) -> None:
    for stats in (wait_until_idle(app, 1), {"prefill": _prefill_stats(app)}):
        for s in stats.values():
            assert s["num_requests_running"] == s["num_requests_waiting"] == 0
            assert s["kv_blocks_used"] == 0

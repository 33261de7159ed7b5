"""`kvray bench serve --overload N`: the report's arithmetic, the /health probe in its own
process, the burst's status classes against a small local server, and one real run past
the caps of a small app on the session's Serve instance."""

from __future__ import annotations

import argparse
import asyncio
import http.server
import json
import os
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from cluster.bench.common.workload import BenchRequest
from cluster.bench.serve import main as bench_serve
from cluster.bench.serve import overload
from cluster.bench.serve.overload import (
    HealthProbe,
    HealthProber,
    Outcome,
    format_overload,
    overload_ok,
    percentile_ms,
    send_burst,
    summarize_overload,
)
from tests.cluster.serve_helpers import KV_CACHE_BYTES, ServePorts, deploy

# -- the report ------------------------------------------------------------------------------


def test_outcomes_fall_in_the_five_classes() -> None:
    assert [Outcome(s, 0.1).kind for s in (200, 429, 503, 500, 413, None)] == [
        "200", "429", "503", "other", "other", "other",
    ]  # fmt: skip
    assert Outcome(None, 5.0, timed_out=True).kind == "timeout"


def test_percentiles_are_nearest_rank_in_ms() -> None:
    values = [i / 1000 for i in range(1, 101)]  # 1..100 ms
    assert percentile_ms(values, 0.5) == pytest.approx(50)
    assert percentile_ms(values, 0.99) == pytest.approx(99)
    assert percentile_ms(values, 1.0) == pytest.approx(100)
    assert percentile_ms([], 0.99) == 0.0


def test_summary_counts_shares_latencies_and_drain() -> None:
    outcomes = (
        [Outcome(200, 2.0)] * 6
        + [Outcome(429, 0.01, error="HTTP 429: full")] * 3
        + [Outcome(503, 0.02)]
        + [Outcome(502, 0.5, error="HTTP 502: bad gateway")] * 2
        + [Outcome(None, 9.0, timed_out=True, error="timeout")]
    )
    health = [HealthProbe(0.002, True)] * 98 + [HealthProbe(0.5, True), HealthProbe(10.0, False)]
    s = summarize_overload(outcomes, health, last_sent=100.0, last_answer=109.0, idle_at=110.5)
    assert s["requests"] == 13
    assert s["counts"] == {"200": 6, "429": 3, "503": 1, "other": 2, "timeout": 1}
    assert sum(s["counts"].values()) == s["requests"]
    assert s["completed_share"] == pytest.approx(6 / 13)
    assert s["answer_ms"]["p99"] == pytest.approx(2000)
    assert s["refusal_ms"]["median"] == pytest.approx(10)  # 429s and 503s together
    assert s["health"] == {
        "probes": 100, "failed": 1, "p50_ms": pytest.approx(2), "p99_ms": pytest.approx(500),
        "max_ms": pytest.approx(10000),
    }  # fmt: skip
    assert s["last_answer_after_last_sent_s"] == pytest.approx(9.0)
    assert s["drain_s"] == pytest.approx(10.5)
    assert s["errors"] == ["2 x HTTP 502: bad gateway", "1 x timeout"]  # 429s are no error
    assert not overload_ok(s)
    text = format_overload(s)
    assert "200 6, 429 3, 503 1, other 2, timeout 1" in text
    assert "completed 46.2%" in text and "p99 500.0 ms" in text
    assert "replicas idle after 10.50 s" in text


def test_a_run_without_replica_stats_says_so_and_refusals_alone_are_fine() -> None:
    outcomes = [Outcome(200, 1.0), Outcome(429, 0.01), Outcome(503, 0.01)]
    s = summarize_overload(outcomes, [], last_sent=1.0, last_answer=2.0, idle_at=None)
    assert s["drain_s"] is None and s["health"]["probes"] == 0
    assert overload_ok(s)
    assert "replica stats unknown" in format_overload(s)


# -- the probe and the burst against a small local server --------------------------------------


class _Handler(http.server.BaseHTTPRequestHandler):
    """/health: 200 with the serving process's pid; POST: the status the prompt's first id
    names (a prompt [0] sleeps past the client timeout)."""

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        self._reply(200, {"pid": os.getpid()})

    def do_POST(self) -> None:  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        status = body["prompt"][0]
        if status == 0:
            threading.Event().wait(2.0)
            status = 200
        self._reply(status, {"error": {"message": "no"}} if status != 200 else {"choices": []})

    def _reply(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *_: object) -> None:
        pass


@pytest.fixture
def local_server() -> Iterator[str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_the_health_probe_runs_in_another_process(local_server: str) -> None:
    prober = HealthProber(f"{local_server}/health", interval_s=0.01)
    threading.Event().wait(0.5)  # this process idles; the probe's runs on
    probes = prober.stop()
    assert probes and all(p.ok for p in probes)
    assert all(p.latency_s < overload.HEALTH_PROBE_TIMEOUT_S for p in probes)


def test_the_burst_classifies_every_answer_and_the_client_timeout(local_server: str) -> None:
    statuses = [200, 200, 429, 503, 500, 0]
    requests = [BenchRequest((s,), 1) for s in statuses]
    outcomes, last_sent, last_answer = asyncio.run(
        send_burst(local_server, "m", requests, api_key="k", timeout_s=1.0, progress=False)
    )
    assert [o.kind for o in outcomes] == ["200", "200", "429", "503", "other", "timeout"]
    assert outcomes[4].error.startswith("HTTP 500")
    assert last_sent <= last_answer


# -- one real run past the caps ----------------------------------------------------------------


@pytest.mark.slow
def test_overload_past_the_caps_of_a_small_app(serve_ports: ServePorts, tmp_path: Path) -> None:
    from ray import serve

    from cluster.config import ServeConfig

    # One replica that runs 2 sequences, queues 2 more and holds 4 requests: a burst of 40
    # is 10x its caps.
    config = ServeConfig.from_flat(
        num_replicas=1,
        kv_cache_memory_bytes=KV_CACHE_BYTES,
        max_num_seqs=2,
        max_queued_requests=2,
        max_ongoing_requests=4,
    )
    app = deploy("kvray-overload", "/overload", config, serve_ports, None)
    try:
        out = tmp_path / "overload.json"
        parser = argparse.ArgumentParser()
        bench_serve.add_arguments(parser)
        args = parser.parse_args(
            [
                "--base-url", app.base_url, "--overload", "40", "--input-len", "24",
                "--output-len", "8", "--warmup-requests", "1", "--app-name", app.name,
                "--num-replicas", "1", "--health-interval-ms", "20", "--result-json", str(out),
            ]
        )  # fmt: skip
        assert bench_serve.run(args) == 0  # nothing hung, nothing but 200 / 429 / 503
        s = json.loads(out.read_text())["overload"]
        c = s["counts"]
        assert sum(c.values()) == 40 and c["other"] == c["timeout"] == 0
        assert c["200"] >= 2 and c["429"] + c["503"] > 0, c  # some served, some refused
        assert s["completed_share"] == pytest.approx(c["200"] / 40)
        assert s["health"]["probes"] > 0 and s["health"]["failed"] == 0, s["health"]
        assert s["drain_s"] is not None and s["drain_s"] >= s["last_answer_after_last_sent_s"]
    finally:
        serve.delete(app.name)

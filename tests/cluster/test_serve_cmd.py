"""`kvray serve`: flags and banner, and the real command joining a Ray cluster (--address),
serving with an API key, and stopping cleanly on SIGTERM or on Ctrl-C while it deploys."""

from __future__ import annotations

import argparse
import contextlib
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from cluster import serve_cmd
from cluster.serve_flags import config_from_flags
from tests.cluster.serve_helpers import KV_CACHE_BYTES, ServePorts

REPO = Path(__file__).resolve().parents[2]


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    serve_cmd.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_defaults_follow_design() -> None:
    args = _parse()
    assert (args.host, args.port, args.grpc_port, args.metrics_port) == (
        "127.0.0.1",
        8000,
        9000,
        8080,
    )
    assert args.address is None and args.api_key is None
    config = config_from_flags(args)
    assert config.model is None and config.num_replicas == 1 and not config.autoscaling


def test_flags_become_config() -> None:
    args = _parse(
        "--min-replicas", "1", "--max-replicas", "3", "--kv-cache-memory", "512MiB",
        "--max-queued-requests", "7", "--tensor-parallel-size", "2", "--no-prefix-caching",
    )  # fmt: skip
    c = config_from_flags(args)
    assert c.autoscaling_config()["max_replicas"] == 3
    assert c.kv_cache_memory_bytes == 512 * 1024**2 and c.max_queued_requests == 7
    assert c.tensor_parallel_size == 2 and not c.enable_prefix_caching


def test_banner_has_urls_and_a_curl_example() -> None:
    args = _parse("--port", "8123")
    text = serve_cmd.banner(config_from_flags(args), args, auth=True)
    assert "http://127.0.0.1:8123/v1" in text
    assert "127.0.0.1:9000" in text and "http://127.0.0.1:8080/metrics" in text
    assert "curl http://127.0.0.1:8123/v1/completions" in text
    assert "Authorization: Bearer $KVRAY_API_KEY" in text


@pytest.mark.slow
def test_serve_joins_a_cluster_serves_and_stops_on_sigterm(serve_ports: ServePorts) -> None:
    import ray
    from ray import serve

    address = ray.get_runtime_context().gcs_address
    env = {**os.environ, "KVRAY_API_KEY": "serve-cmd-key"}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "cluster.cli",
            "serve",
            "--address",
            address,
            "--kv-cache-memory",
            str(KV_CACHE_BYTES),
            "--max-num-seqs",
            "8",
            "--port",
            str(serve_ports.http),
            "--grpc-port",
            str(serve_ports.grpc),
        ],  # fmt: skip
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(x) for x in proc.stdout], daemon=True).start()
    out: list[str] = []
    try:
        deadline = time.monotonic() + 300  # a hang guard, not a measurement
        while not any("kvray is serving" in x for x in out):
            assert proc.poll() is None, "".join(out)
            assert time.monotonic() < deadline, "".join(out)
            try:
                out.append(lines.get(timeout=1))
            except queue.Empty:
                pass
        base = f"http://127.0.0.1:{serve_ports.http}"
        assert httpx.get(f"{base}/health").status_code == 200
        body = {"model": "kvray-demo", "prompt": "Once upon a time", "max_tokens": 4}
        # The key from KVRAY_API_KEY reached the replicas of the joined cluster.
        assert httpx.post(f"{base}/v1/completions", json=body).status_code == 401
        ok = httpx.post(
            f"{base}/v1/completions",
            json=body,
            headers={"Authorization": "Bearer serve-cmd-key"},
            timeout=120,
        )
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] >= 1
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=180) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    # It removed its own application (and left the shared Serve instance running).
    assert "kvray" not in serve.status().applications


@pytest.mark.slow
def test_ctrl_c_while_deploying_stops_cleanly(serve_ports: ServePorts) -> None:
    import ray
    from ray import serve

    address = ray.get_runtime_context().gcs_address
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "cluster.cli",
            "serve",
            "--address",
            address,
            "--kv-cache-memory",
            str(KV_CACHE_BYTES),
            "--port",
            str(serve_ports.http),
            "--grpc-port",
            str(serve_ports.grpc),
        ],  # fmt: skip
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(x) for x in proc.stdout], daemon=True).start()
    out: list[str] = []
    try:
        deadline = time.monotonic() + 300  # a hang guard, not a measurement
        while not any("deploying kvray-demo" in x for x in out):
            assert proc.poll() is None, "".join(out)
            assert time.monotonic() < deadline, "".join(out)
            with contextlib.suppress(queue.Empty):
                out.append(lines.get(timeout=1))
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=180) == 130
    finally:
        if proc.poll() is None:
            proc.kill()
    while True:  # the reader thread ends with the process's output
        try:
            out.append(lines.get(timeout=5))
        except queue.Empty:
            break
    text = "".join(out)
    assert "interrupted while starting" in text and "Traceback" not in text, text
    assert "kvray" not in serve.status().applications

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

from cluster.cli import serve as serve_cmd
from cluster.cli.flags import config_from_flags
from tests.cluster.serve_helpers import KV_CACHE_BYTES, ServePorts

REPO = Path(__file__).resolve().parents[3]


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


def test_every_config_field_is_a_flag_with_the_configs_default() -> None:
    from dataclasses import fields

    from cluster.config import ServeConfig

    assert config_from_flags(_parse()) == ServeConfig()  # no flag restates a default
    c = config_from_flags(
        _parse("--block-size", "32", "--tp", "2", "--no-engine-process", "--device", "cpu",
               "--grpc-max-message-bytes", "8MiB", "--model", "rel/ckpt")
    )  # fmt: skip
    assert c.block_size == 32 and c.tensor_parallel_size == 2 and not c.engine_process
    assert c.grpc_max_message_bytes == 8 << 20 and c.device == "cpu"
    assert c.model == os.path.abspath("rel/ckpt")
    assert {f.name for f in fields(ServeConfig)} <= set(vars(_parse()))
    with pytest.raises(SystemExit):
        _parse("--kv-cache-memory", "lots")


def test_banner_has_urls_and_a_curl_example() -> None:
    args = _parse("--port", "8123")
    text = serve_cmd.banner(config_from_flags(args), args, auth=True)
    assert "http://127.0.0.1:8123/v1" in text
    assert "127.0.0.1:9000" in text and "http://127.0.0.1:8080/metrics" in text
    assert "curl http://127.0.0.1:8123/v1/completions" in text
    assert "Authorization: Bearer $KVRAY_API_KEY" in text


class ServeProcess:
    """`kvray serve --address` joining this session's Ray cluster, as a child process whose
    output a thread reads line by line; leaving the `with` block kills it if still running."""

    def __init__(self, ports: ServePorts, *flags: str, env: dict[str, str] | None = None) -> None:
        import ray

        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "cluster.cli.main",
                "serve",
                "--address",
                ray.get_runtime_context().gcs_address,
                "--kv-cache-memory",
                str(KV_CACHE_BYTES),
                "--port",
                str(ports.http),
                "--grpc-port",
                str(ports.grpc),
                *flags,
            ],  # fmt: skip
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self._lines: queue.Queue[str] = queue.Queue()
        threading.Thread(
            target=lambda: [self._lines.put(x) for x in self.proc.stdout], daemon=True
        ).start()
        self.out: list[str] = []

    def __enter__(self) -> ServeProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proc.poll() is None:
            self.proc.kill()

    @property
    def text(self) -> str:
        return "".join(self.out)

    def wait_for(self, line_part: str, timeout_s: float = 300) -> None:
        """Until an output line contains `line_part` (a hang guard, not a measurement)."""
        deadline = time.monotonic() + timeout_s
        while not any(line_part in x for x in self.out):
            assert self.proc.poll() is None, self.text
            assert time.monotonic() < deadline, self.text
            with contextlib.suppress(queue.Empty):
                self.out.append(self._lines.get(timeout=1))

    def read_rest(self) -> None:
        """The output left once the process has exited (the reader ends with it)."""
        while True:
            try:
                self.out.append(self._lines.get(timeout=5))
            except queue.Empty:
                return


@pytest.mark.slow
def test_serve_joins_a_cluster_serves_and_stops_on_sigterm(serve_ports: ServePorts) -> None:
    from ray import serve

    env = {**os.environ, "KVRAY_API_KEY": "serve-cmd-key"}
    with ServeProcess(serve_ports, "--max-num-seqs", "8", env=env) as server:
        server.wait_for("kvray is serving")
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
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(timeout=180) == 0
    # It removed its own application (and left the shared Serve instance running).
    assert "kvray" not in serve.status().applications


@pytest.mark.slow
def test_ctrl_c_while_deploying_stops_cleanly(serve_ports: ServePorts) -> None:
    from ray import serve

    with ServeProcess(serve_ports) as server:
        server.wait_for("deploying kvray-demo")
        server.proc.send_signal(signal.SIGINT)
        assert server.proc.wait(timeout=180) == 130
    server.read_rest()
    assert "interrupted while starting" in server.text and "Traceback" not in server.text, (
        server.text
    )
    assert "kvray" not in serve.status().applications

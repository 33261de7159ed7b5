"""`kvray serve`: flags and banner, and the real command joining a Ray cluster (--address),
serving with an API key, and stopping cleanly on SIGTERM or on Ctrl-C while it deploys; on its
own Ray: a taken port is a one-line error, SIGTERM drains an in-flight stream and leaves no
process behind, a start after Ray's processes were killed (HAProxy left over) works, and its
console shows kvray's lines and no INFO line of Ray's or Serve's."""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import psutil
import pytest

from cluster.cli import serve as serve_cmd
from cluster.cli.flags import config_from_flags
from cluster.cli.ports import port_in_use, serve_haproxies
from cluster.deploy.serve_env import LOCAL_PORT_KEYS
from tests.cluster.cli.serve_process import ServeProcess, kill
from tests.cluster.serve_helpers import ServePorts, free_port

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
    assert config.engine.model is None and config.replicas.num_replicas == 1
    assert not config.autoscaling.enabled


def test_flags_become_config() -> None:
    args = _parse(
        "--min-replicas", "1", "--max-replicas", "3", "--kv-cache-memory", "512MiB",
        "--max-queued-requests", "7", "--tensor-parallel-size", "2", "--no-prefix-caching",
    )  # fmt: skip
    c = config_from_flags(args)
    assert c.autoscaling_config()["max_replicas"] == 3
    assert c.engine.kv_cache_memory_bytes == 512 * 1024**2 and c.limits.max_queued_requests == 7
    assert c.engine.tensor_parallel_size == 2 and not c.engine.enable_prefix_caching


def test_every_config_field_is_a_flag_with_the_configs_default() -> None:
    from cluster.config import ServeConfig

    assert config_from_flags(_parse()) == ServeConfig()  # no flag restates a default
    c = config_from_flags(
        _parse("--block-size", "32", "--tp", "2", "--no-engine-process", "--device", "cpu",
               "--grpc-max-message-bytes", "8MiB", "--model", "rel/ckpt")
    )  # fmt: skip
    assert c.engine.block_size == 32 and c.engine.tensor_parallel_size == 2
    assert not c.replicas.engine_process
    assert c.network.grpc_max_message_bytes == 8 << 20 and c.engine.device == "cpu"
    assert c.engine.model == os.path.abspath("rel/ckpt")
    assert {f.name for _, f, _ in ServeConfig.settings()} <= set(vars(_parse()))
    with pytest.raises(SystemExit):
        _parse("--kv-cache-memory", "lots")


def test_banner_has_urls_and_a_curl_example() -> None:
    args = _parse("--port", "8123")
    text = serve_cmd.banner(config_from_flags(args), args, auth=True)
    assert "http://127.0.0.1:8123/v1" in text
    assert "127.0.0.1:9000" in text and "http://127.0.0.1:8080/metrics" in text
    assert "curl http://127.0.0.1:8123/v1/completions" in text
    assert "Authorization: Bearer $KVRAY_API_KEY" in text


def test_banner_counts_decode_and_prefill_replicas() -> None:
    tier = ("--kv-offload-gib", "1", "--kv-share-gib", "1", "--prefill-replicas", "1")
    args = _parse("--decode-replicas", "2", *tier)
    text = serve_cmd.banner(config_from_flags(args), args, auth=False)
    assert "(2 decode + 1 prefill (--pd auto) replica(s))" in text
    args = _parse("--max-replicas", "4", *tier, "--prefill-max-replicas", "3", "--pd", "always")
    text = serve_cmd.banner(config_from_flags(args), args, auth=False)
    assert "(1-4 decode + 1-3 prefill (--pd always) replica(s))" in text


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


def _haproxy_dirs(procs: list[psutil.Process]) -> set[str]:
    """The per-node config directories of the Serve HAProxy processes among `procs`."""
    ours = {p.pid for p in procs}
    return {
        os.path.dirname(arg)
        for p in serve_haproxies()
        if p.pid in ours
        for arg in p.cmdline()
        if arg.endswith("haproxy.cfg")
    }


def _assert_all_gone(procs: list[psutil.Process], haproxy_dirs: set[str]) -> None:
    alive = [p for p in procs if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert not alive, [(p.pid, p.cmdline()) for p in alive]
    # HAProxy restarts on every reload: also none started after `procs` was taken.
    for d in haproxy_dirs:
        assert not serve_haproxies(d), d


def test_a_taken_port_is_a_one_line_error() -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        env = {k: v for k, v in os.environ.items() if k not in LOCAL_PORT_KEYS}
        done = subprocess.run(
            [sys.executable, "-m", "cluster.cli.main", "serve", "--port", str(port)],
            cwd=REPO, env=env, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
    assert done.returncode == 1, done
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith(
        f"kvray serve: HTTP port {port} is already in use by pid {os.getpid()} "
    )
    assert "Traceback" not in done.stdout + done.stderr


def _first_not_ready(base: str) -> tuple[int, int | str]:
    """The first /ready status other than 200 after a signal, and what a new completion
    request gets right then: a status, or "closed" once the listener is going away (a hang
    guard of 60 s, not a measurement)."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            status = httpx.get(f"{base}/ready", timeout=10).status_code
        except httpx.HTTPError as err:
            raise AssertionError(f"/ready never answered 503: {err!r}") from err
        if status != 200:
            body = {"model": "kvray-demo", "prompt": "hi", "max_tokens": 4}
            try:
                r = httpx.post(f"{base}/v1/completions", json=body, timeout=30)
            except httpx.HTTPError:
                return status, "closed"
            if r.status_code == 503:
                assert r.json()["error"]["type"] == "service_unavailable", r.text
            return status, r.status_code
        time.sleep(0.05)
    raise AssertionError("/ready stayed 200 for 60 s after the signal")


def _stream(base: str, result: dict[str, object], first_chunk: threading.Event) -> None:
    # Long enough to be in flight while the ingress turns draining (about a second).
    body = {"model": "kvray-demo", "prompt": "Once upon a time", "max_tokens": 1500,
            "ignore_eos": True, "stream": True}  # fmt: skip
    chunks = 0
    with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=300) as r:
        result["status"] = r.status_code
        for line in r.iter_lines():
            if line == "data: [DONE]":
                result["done"] = True
            elif line.startswith("data: "):
                chunks += 1
                first_chunk.set()
    result["chunks"] = chunks
    first_chunk.set()


def _sigterm_drains_an_in_flight_stream(server: ServeProcess, ports: ServePorts) -> None:
    """SIGTERM with a stream in flight: /ready turns 503 at once, a new request is refused,
    the stream completes, kvray exits 0 without a traceback of its own."""
    result: dict[str, object] = {}
    first_chunk = threading.Event()
    base = f"http://127.0.0.1:{ports.http}"
    client = threading.Thread(target=_stream, args=(base, result, first_chunk))
    client.start()
    assert first_chunk.wait(timeout=120), result
    assert httpx.get(f"{base}/ready", timeout=30).status_code == 200
    engines = _engine_replica_pids(server)
    assert engines, [p.cmdline() for p in server.descendants()]
    server.proc.send_signal(signal.SIGTERM)
    try:
        ready, refused = _first_not_ready(base)
        # The drain notice reconfigured the ingress; it replaced no engine replica.
        assert _engine_replica_pids(server) <= engines
    finally:
        client.join(timeout=300)
    assert result.get("status") == 200 and result.get("done"), result
    # Readiness fails at once (503 before Serve drops the route: 404); a new one is refused.
    assert ready == 503, (ready, server.text)
    assert refused in (503, 404, "closed"), refused
    rc = server.proc.wait(timeout=300)
    server.read_rest()
    assert rc == 0, server.text
    # kvray's own output; Ray's actors' logs (forwarded, prefixed "(Name pid=N)") may carry
    # tracebacks of Serve's own shutdown races (its HAProxy manager reloading mid-stop).
    assert "Traceback" not in _own_lines(server.text), server.text
    assert "could not mark the ingress draining" not in server.text, server.text


def _engine_replica_pids(server: ServeProcess) -> set[int]:
    """The engine replicas' processes (titled `ray::ServeReplica:APP:LLMServer`)."""
    pids = set()
    for proc in server.descendants():
        with contextlib.suppress(psutil.Error):
            if "ServeReplica" in " ".join(proc.cmdline()) and "LLMServer" in " ".join(
                proc.cmdline()
            ):
                pids.add(proc.pid)
    return pids


@pytest.mark.slow
def test_after_rays_processes_are_killed_the_next_serve_starts_and_drains_on_sigterm() -> None:
    """`ray stop --force` (or a crash) leaves Serve's HAProxy behind: the next `kvray serve`
    stops it and starts; a third on the same ports is a one-line error naming the port; the
    second then drains an in-flight stream on SIGTERM and leaves nothing running (one test:
    each `kvray serve` start costs tens of seconds)."""
    ports = ServePorts(http=free_port(), grpc=free_port())
    with ServeProcess(ports, local=True) as first:
        first.wait_for("kvray is serving")
        # As `ray stop --force` (or a crash) does: every process of it but HAProxy dies.
        procs = first.descendants()
        kill([p for p in procs if "haproxy" not in p.name()] + [psutil.Process(first.proc.pid)])
        assert port_in_use(ports.http)  # the orphaned HAProxy still holds the HTTP port
        left_over = [p for p in procs if p.is_running() and "haproxy" in p.name()]
        assert left_over
    with ServeProcess(ports, local=True) as second:
        second.wait_for("kvray is serving")
        assert "left behind by a Ray instance that is gone" in second.text, second.text
        assert not any(p.is_running() for p in left_over)
        procs = second.descendants()
        haproxy_dirs = _haproxy_dirs(procs)
        # A third on the same ports: the port is taken by the second's HAProxy, named.
        env = {k: v for k, v in os.environ.items() if k not in LOCAL_PORT_KEYS}
        third = subprocess.run(
            [sys.executable, "-m", "cluster.cli.main", "serve", "--port", str(ports.http),
             "--grpc-port", str(ports.grpc), "--metrics-port", str(free_port())],
            cwd=REPO, env=env, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert third.returncode == 1, third
        line = f"kvray serve: HTTP port {ports.http} is already in use by pid "
        assert third.stderr.startswith(line) and "haproxy" in third.stderr, third.stderr
        assert len(third.stderr.strip().splitlines()) == 1, third.stderr
        assert haproxy_dirs  # it runs behind HAProxy
        _sigterm_drains_an_in_flight_stream(second, ports)
    _assert_quiet_console(second.text, ports)
    _assert_all_gone(procs, haproxy_dirs)


def _assert_quiet_console(text: str, ports: ServePorts) -> None:
    """The default --log-level: kvray's own lines, the URLs and warnings on the console; Ray's
    and Serve's INFO lines (forwarded ones prefixed "(ServeController pid=N)" and the like, or
    this process's Serve logger's) only in the logs directory it names."""
    import re

    for line in text.splitlines():  # INFO only in kvray's own lines: "DATE TIME INFO kvray..."
        assert "INFO" not in line or line.split(" ", 3)[2:4][:1] == ["INFO"], line
        assert "INFO" not in line or line.split(" ", 3)[3].startswith("kvray."), line
    assert f"http://127.0.0.1:{ports.http}/v1" in text and "metrics    : http://" in text
    logs = re.search(r"Ray and Serve logs: (\S+);", text)
    assert logs, text
    controller = "".join(p.read_text() for p in Path(logs[1], "serve").glob("controller_*.log"))
    assert "INFO" in controller and "Deploying new version" in controller


def _own_lines(text: str) -> str:
    """The lines kvray's process wrote itself, without Ray's forwarded actor and raylet logs."""
    import re

    forwarded = re.compile(r"^(\x1b\[\d+m)?\((raylet|[\w:.-]+ pid=\d+)\)")
    return "\n".join(line for line in text.splitlines() if not forwarded.match(line))

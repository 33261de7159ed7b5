"""`kvray bench serve --fault-at S`: the report's arithmetic on synthetic streams, the kill's
guard on real processes, the HTTP stream client against a small local server, and one real
run that kills a replica's engine on the session's Serve instance."""

from __future__ import annotations

import argparse
import asyncio
import http.server
import json
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from cluster.bench.common.backend_types import BackendContext
from cluster.bench.common.workload import BenchRequest
from cluster.bench.fault import main as fault
from cluster.bench.fault.report import (
    KillEvent,
    active_at,
    fault_ok,
    format_fault,
    longest_gap_after,
    next_token_after,
    per_second,
    summarize_fault,
    tokens_between,
)
from cluster.bench.fault.stream import HttpStreams, StreamTrace
from cluster.bench.serve import main as bench_serve
from tests.cluster.serve_helpers import KV_CACHE_BYTES, ServePorts, deploy


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    bench_serve.add_arguments(parser)
    return parser.parse_args(list(argv))


def _trace(sent: float, chunks: list[tuple[float, int]], end: float, **kw: object) -> StreamTrace:
    t = StreamTrace(sent, prompt_len=8, max_tokens=100, chunks=chunks, end=end)
    for k, v in kw.items():
        setattr(t, k, v)
    return t


# -- the report ------------------------------------------------------------------------------


def test_stream_timing_around_the_kill() -> None:
    # Chunks at 1, 2, 3 (a token in flight at the kill, 2.5), then a 2 s stall, then 5.5, 6.
    t = _trace(0.0, [(1.0, 2), (2.0, 2), (2.6, 1), (4.6, 3), (5.0, 1)], end=5.1, ok=True)
    assert active_at(t, 2.5) and not active_at(t, 5.1) and not active_at(t, 0.0)
    assert next_token_after(t, 2.5) == pytest.approx(0.1)  # the token already on its way
    assert longest_gap_after(t, 2.5) == pytest.approx(2.0)  # ... then the stall
    assert longest_gap_after(t, 2.5, window_s=0.05) == pytest.approx(0.1)  # stall began late
    assert next_token_after(t, 5.0) == 0.0 and next_token_after(t, 5.01) is None
    # No chunk after the kill: it waited from the kill to its end (a failure).
    assert longest_gap_after(_trace(0.0, [(1.0, 1)], end=3.0), 2.0) == pytest.approx(1.0)
    assert tokens_between([t, t], 2.0, 4.6) == 2 * 3  # [lo, hi)
    assert per_second([t], 0.0, 5.1) == [0, 2, 3, 0, 3, 1]


def test_summary_counts_failures_stalls_and_throughput_around_the_kill() -> None:
    kill = KillEvent(
        "engine", at=10.0, replica="r1", pid=4242, running=2, waiting=1, replicas_seen=2,
        pid_gone=True,
    )  # fmt: skip
    traces = [
        # On the killed replica: got 20 tokens, then the 503 at 10.2.
        _trace(1.0, [(2.0, 10), (9.0, 10)], end=10.2, status="503", error="engine died"),
        # Migrated: a 3 s stall after the kill, completes with exact usage.
        _trace(
            1.0, [(2.0, 10), (9.5, 10), (13.0, 10)], end=13.1, ok=True, status="200", output_len=30
        ),
        # Elsewhere: ticks on; its usage disagrees with what it received.
        _trace(
            0.0, [(5.0, 10), (10.5, 10), (12.0, 10)], end=12.0, ok=True, status="200", output_len=31
        ),
        _trace(0.0, [(3.0, 10)], end=3.0, ok=True, status="200", output_len=10),  # done before
        _trace(11.0, [], end=11.1, status="503", error="no healthy engine replica"),  # after
    ]
    s = summarize_fault(traces, kill, t0=0.0, end=20.0, whole_at=40.0, stall_s=2.0)
    assert (s["requests"], s["completed"], s["failed"]) == (5, 3, 2)
    assert s["failed_by_status"] == {"503": 2}
    assert s["usage_mismatches"] == 1 and not fault_ok(s)
    assert s["output_tokens_received"] == 90
    f = s["fault"]
    assert (f["at_s"], f["victim_in_flight"], f["pid"], f["whole_again_s"]) == (10.0, 3, 4242, 30.0)
    assert (f["active_at_kill"], f["active_completed"], f["active_failed"]) == (3, 2, 1)
    assert f["interrupted"] == 2  # the failed one and the 3 s stall, not the 1.5 s gap
    n, g = f["next_token_after_kill_ms"], f["longest_gap_after_kill_ms"]
    assert n["streams"] == 2 and n["p50"] == pytest.approx(500) and n["max"] == pytest.approx(3000)
    assert g["streams"] == 2 and g["max"] == pytest.approx(3000)
    assert f["tokens_in_failed_streams"] == 20
    assert f["throughput_before"] == pytest.approx(60 / 10)  # tokens at 2, 2, 3, 5, 9, 9.5
    assert f["throughput_after"] == pytest.approx(30 / 10)
    assert f["throughput_after_same_length"] == pytest.approx(30 / 10)
    assert len(f["active_streams"]) == 3
    text = format_fault(s)
    assert "5 requests, 3 completed, 2 failed (503 2)" in text
    assert "killed the engine process of replica r1 (pid 4242) at 10.00 s" in text
    assert "2 running + 1 waiting" in text and "whole again: 30.0 s after the kill" in text
    assert "usage != tokens received in 1 completed stream(s)" in text


def test_a_stream_with_only_its_end_after_the_kill_is_counted_apart() -> None:
    # Active at the kill with every token already received: only its usage came after.
    kill = KillEvent("engine", at=10.0, replica="r1", pid=7, replicas_seen=2, pid_gone=True)
    traces = [
        _trace(0.0, [(9.9, 10)], end=10.3, ok=True, status="200", output_len=10),
        _trace(0.0, [(9.0, 5), (10.4, 5)], end=10.5, ok=True, status="200", output_len=10),
    ]
    f = summarize_fault(traces, kill, t0=0.0, end=11.0, whole_at=None)["fault"]
    assert (f["active_at_kill"], f["active_completed"], f["active_tail_only"]) == (2, 2, 1)
    assert f["next_token_after_kill_ms"]["streams"] == 1
    assert "(1 streams; 1 had only their end left)" in format_fault(
        summarize_fault(traces, kill, t0=0.0, end=11.0, whole_at=None)
    )


def test_a_run_without_a_kill_reports_why_and_is_not_ok() -> None:
    traces = [_trace(0.0, [(1.0, 5)], end=1.0, ok=True, status="200", output_len=5)]
    s = summarize_fault(traces, None, t0=0.0, end=1.0, whole_at=None)
    assert s["fault"] is None and s["fault_error"] == "the run ended before the fault"
    assert not fault_ok(s) and "no fault: the run ended before the fault" in format_fault(s)
    failed = KillEvent("engine", at=0.5, error="no engine pid")
    assert summarize_fault(traces, failed, t0=0.0, end=1.0, whole_at=None)["fault_error"] == (
        "no engine pid"
    )
    alive = KillEvent("replica", at=0.5, replica="r", pid=1)
    s = summarize_fault(traces, alive, t0=0.0, end=1.0, whole_at=None)
    assert not fault_ok(s) and "(pid 1, STILL RUNNING)" in format_fault(s)
    gone = KillEvent("replica", at=0.5, replica="r", pid=1, pid_gone=True)
    assert fault_ok(summarize_fault(traces, gone, t0=0.0, end=1.0, whole_at=None))


# -- picking and killing --------------------------------------------------------------------


def test_the_busiest_replica_has_most_running_then_most_waiting() -> None:
    def stats(name: str, running: int, waiting: int, queued: int) -> dict[str, object]:
        return {
            "replica": name,
            "num_requests_running": running,
            "num_requests_waiting": waiting,
            "queued": queued,
            "engine_pid": 7,
            "pid": 8,
        }

    replicas = {s["replica"]: s for s in (stats("a", 3, 0, 0), stats("b", 3, 1, 1),
                                          stats("c", 2, 9, 9))}  # fmt: skip
    victim = fault.busiest(replicas)
    assert victim is not None and victim["replica"] == "b"
    assert fault.busiest({}) is None
    assert (fault.target_pid(victim, "engine"), fault.target_pid(victim, "replica")) == (7, 8)


def _wait_for_cmdline(pid: int, needle: str, timeout_s: float = 30.0) -> None:
    import psutil

    deadline = time.monotonic() + timeout_s
    while needle not in " ".join(psutil.Process(pid).cmdline()):
        assert time.monotonic() < deadline, f"pid {pid} never showed its command line"
        time.sleep(0.01)


def test_the_kill_checks_its_target_is_that_kind_of_process() -> None:
    # A stand-in engine: its command line names the engine module, as a real engine's does.
    proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import time; time.sleep(60)",
            "-m",
            "workers.core.engine_child",
        ]
    )
    try:
        # Popen returns once exec has begun; the kernel fills in the new command line a moment
        # later (until then /proc shows it empty), so wait for it as a real engine would have.
        _wait_for_cmdline(proc.pid, "workers.core.engine_child")
        assert "is not a replica process" in fault.kill_process(proc.pid, "replica")
        assert not fault.pid_gone(proc.pid)
        assert fault.kill_process(proc.pid, "engine") == ""
        assert proc.wait(timeout=30) == -9  # SIGKILL
        assert fault.pid_gone(proc.pid)
    finally:
        proc.kill()
    assert "not a process on this machine" in fault.kill_process(proc.pid, "engine")


def test_the_workload_draws_long_outputs_over_the_chosen_prompts() -> None:
    args = _args("--fault-at", "1", "--num-prompts", "50", "--input-len", "12",
                 "--fault-output-len", "256", "600")  # fmt: skip
    w = fault.fault_workload(args, list(range(100, 200)))
    assert len(w.requests) == 50 and all(r.prompt_len == 12 for r in w.requests)
    assert all(256 <= r.output_len <= 600 for r in w.requests)
    assert len({r.output_len for r in w.requests}) > 10
    assert w.params["output_len_range"] == [256, 600] and "output_len" not in w.params
    bad = _args("--fault-at", "1", "--fault-output-len", "9", "3")
    with pytest.raises(ValueError, match="--fault-output-len"):
        fault.fault_workload(bad, [1, 2, 3])


def test_the_command_refuses_what_it_cannot_run() -> None:
    for argv in (
        ["--launch", "--backend", "inprocess"],
        ["--launch", "--backend", "http,grpc"],
        ["--launch", "--workload", "json-schema"],
        ["--base-url", "http://127.0.0.1:1"],  # no Ray connection to find the replicas
    ):
        assert bench_serve.run(_args("--fault-at", "1", *argv)) == 2, argv


# -- the HTTP stream client ------------------------------------------------------------------


class _Sse(http.server.BaseHTTPRequestHandler):
    """Streams 3 + 2 tokens (logprobs lists them), then usage, or an error frame when the
    prompt's first id is 503."""

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        assert body["logprobs"] == 0 and body["stream"]
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for n in (3, 2):
            chunk = {"choices": [{"text": "x" * n, "logprobs": {"tokens": ["x"] * n}}]}
            self.wfile.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
            self.wfile.flush()
        last = (
            {"error": {"message": "engine died", "code": 503}}
            if body["prompt"][0] == 503
            else {"choices": [], "usage": {"completion_tokens": 5}}
        )
        self.wfile.write(b"data: " + json.dumps(last).encode() + b"\n\ndata: [DONE]\n\n")

    def log_message(self, *_: object) -> None:
        pass


@pytest.fixture
def sse_server() -> Iterator[str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Sse)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_the_http_client_counts_tokens_per_chunk_and_keeps_mid_stream_errors(
    sse_server: str,
) -> None:
    async def go() -> list[StreamTrace]:
        client = await HttpStreams.open(BackendContext("m", "", base_url=sse_server))
        try:
            return [await client.send(BenchRequest((p, 1), 5)) for p in (1, 503)]
        finally:
            await client.close()

    done, failed = asyncio.run(go())
    assert done.ok and done.status == "200" and done.output_len == done.tokens == 5
    assert [n for _, n in done.chunks] == [3, 2] and done.sent <= done.chunks[0][0] <= done.end
    assert not failed.ok and (failed.status, failed.error) == ("503", "engine died")
    assert failed.tokens == 5 and failed.output_len == 0


# -- one real run ----------------------------------------------------------------------------


@pytest.mark.slow
def test_a_real_run_kills_the_busiest_engine(serve_ports: ServePorts, tmp_path: Path) -> None:
    from ray import serve

    from cluster.config import ServeConfig

    config = ServeConfig.from_flat(
        num_replicas=2, kv_cache_memory_bytes=KV_CACHE_BYTES, max_num_seqs=8
    )
    app = deploy("kvray-fault", "/fault", config, serve_ports, None)
    try:
        out = tmp_path / "fault.json"
        args = _args(
            "--base-url", app.base_url, "--app-name", app.name, "--num-replicas", "2",
            "--fault-at", "1", "--num-prompts", "6", "--max-concurrency", "6",
            "--input-len", "16", "--fault-output-len", "300", "500", "--warmup-requests", "1",
            "--fault-recovery-timeout-s", "0", "--result-json", str(out),
        )  # fmt: skip
        rc = bench_serve.run(args)
        s = json.loads(out.read_text())["fault"]
        f = s["fault"]
        assert f is not None, s.get("fault_error")
        assert f["kind"] == "engine" and f["replicas_seen"] == 2
        assert f["pid_gone"] and fault.pid_gone(f["pid"])  # dead (at most a zombie)
        assert f["victim_in_flight"] >= 1 and f["active_at_kill"] >= 1
        assert s["completed"] + s["failed"] == s["requests"] == 6
        assert sum(s["failed_by_status"].values()) == s["failed"]
        assert f["active_completed"] + f["active_failed"] == f["active_at_kill"]
        # A stream may be active at the kill with only its end left to send (no token after).
        tail = f["active_tail_only"]
        assert f["next_token_after_kill_ms"]["streams"] >= f["active_completed"] - tail
        assert f["throughput_before"] > 0 and f["whole_again_s"] is None  # not watched
        # Every stream survived the kill (request migration) with exact usage: exit code 0.
        assert s["failed"] == 0 and s["usage_mismatches"] == 0 and f["active_failed"] == 0
        assert rc == 0
    finally:
        serve.delete(app.name)

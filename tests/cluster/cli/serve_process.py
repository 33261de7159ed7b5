"""`kvray serve` as a child process of a test: its output read line by line, and nothing of
it left behind (its processes, or its apps on the shared Ray cluster) when the test fails."""

from __future__ import annotations

import contextlib
import os
import queue
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil

from cluster.cli.config import APP_NAME
from cluster.deploy.liveness import liveness_app_name
from cluster.deploy.serve_env import LOCAL_PORT_KEYS
from tests.cluster.serve_helpers import KV_CACHE_BYTES, TEST_GRPC_DRAIN_S, ServePorts, free_port

REPO = Path(__file__).resolve().parents[3]


class ServeProcess:
    """`kvray serve --address` joining this session's Ray cluster, as a child process whose
    output a thread reads line by line; leaving the `with` block kills it if still running."""

    def __init__(
        self,
        ports: ServePorts,
        *flags: str,
        env: dict[str, str] | None = None,
        local: bool = False,
    ) -> None:
        if local:  # its own Ray instance, choosing its own ports for Serve's other listeners
            env = {k: v for k, v in (env or os.environ).items() if k not in LOCAL_PORT_KEYS}
            where = ["--metrics-port", str(free_port())]
        else:
            import ray

            where = ["--address", ray.get_runtime_context().gcs_address]
        self._joined = not local
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "cluster.cli.main",
                "serve",
                *where,
                "--kv-cache-memory",
                str(KV_CACHE_BYTES),
                "--port",
                str(ports.http),
                "--grpc-port",
                str(ports.grpc),
                "--grpc-drain-s",
                str(TEST_GRPC_DRAIN_S),  # nothing probes these: a short drain
                *flags,
            ],  # fmt: skip
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self._lines: queue.Queue[str] = queue.Queue()
        self._reader = threading.Thread(
            target=lambda: [self._lines.put(x) for x in self.proc.stdout], daemon=True
        )
        self._reader.start()
        self.out: list[str] = []

    def __enter__(self) -> ServeProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proc.poll() is None:  # a failed test: leave no Ray instance behind
            kill([*self.descendants(), psutil.Process(self.proc.pid)])
        if self._joined:  # nor its apps on the shared cluster (its gRPC port is the shared app's)
            from ray import serve

            for name in (APP_NAME, liveness_app_name(APP_NAME)):
                if name in serve.status().applications:
                    serve.delete(name)

    def descendants(self) -> list[psutil.Process]:
        """Every process it started (Ray's, replicas, engines, HAProxy), while it runs."""
        return psutil.Process(self.proc.pid).children(recursive=True)

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
        """The output left once the process has exited: the reader ends at the end of its
        output (at most 5 s more where a process it left behind still holds the pipe)."""
        self._reader.join(timeout=5)
        while True:
            try:
                self.out.append(self._lines.get_nowait())
            except queue.Empty:
                return


def kill(procs: list[psutil.Process]) -> None:
    for p in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()
    psutil.wait_procs(procs, timeout=30)

"""The `helm test` pod's script, taken from the rendered Pod, run against a real HTTP server
and a real grpc.health.v1 server: it passes only when everything it checks is serving."""

from __future__ import annotations

import subprocess
import sys
import threading
from collections.abc import Iterator
from concurrent import futures
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from tests.helm.helpers import of_kind


class _Endpoints:
    """A stand-in kvray: HTTP /health and /ready, and gRPC health, each switchable."""

    def __init__(self) -> None:
        import grpc
        from grpc_health.v1 import health, health_pb2_grpc

        self.ready_status = 200
        endpoints = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                status = {"/health": 200, "/ready": endpoints.ready_status}.get(self.path, 404)
                self.send_response(status)
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self.http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.http.serve_forever, daemon=True).start()
        self.health = health.HealthServicer()
        self.grpc = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.grpc)
        self.grpc_port = self.grpc.add_insecure_port("127.0.0.1:0")
        self.grpc.start()

    def set_grpc(self, serving: bool) -> None:
        from grpc_health.v1 import health_pb2

        status = health_pb2.HealthCheckResponse
        self.health.set("kvray.v1.LLMService", status.SERVING if serving else status.NOT_SERVING)

    def close(self) -> None:
        self.http.shutdown()
        self.http.server_close()
        self.grpc.stop(None)


@pytest.fixture(scope="module")
def endpoints() -> Iterator[_Endpoints]:
    stand_in = _Endpoints()
    yield stand_in
    stand_in.close()


@pytest.fixture(scope="module")
def script(render) -> str:
    (pod,) = of_kind(render(None), "Pod")
    command = pod["spec"]["containers"][0]["command"]
    assert command[:2] == ["python", "-c"]
    return command[2]


def _run(script: str, endpoints: _Endpoints) -> subprocess.CompletedProcess[str]:
    http_url = f"http://127.0.0.1:{endpoints.http.server_address[1]}"
    grpc_target = f"127.0.0.1:{endpoints.grpc_port}"
    return subprocess.run(
        [sys.executable, "-c", script, http_url, grpc_target],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


@pytest.mark.parametrize(
    ("ready_status", "grpc_serving", "passes"),
    [(200, True, True), (503, True, False), (200, False, False)],
)
def test_smoke_test(script, endpoints, ready_status, grpc_serving, passes):
    endpoints.ready_status = ready_status
    endpoints.set_grpc(grpc_serving)
    result = _run(script, endpoints)
    assert (result.returncode == 0) is passes, result.stdout + result.stderr
    if passes:
        assert "SERVING" in result.stdout

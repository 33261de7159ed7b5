"""The `helm test` pod's script, taken from the rendered Pod, run against a real HTTP server
and a real grpc.health.v1 server: it passes only when everything it checks is serving. With
tls.enabled, both servers speak TLS with a certificate for a name other than the address the
script dials (as in a cluster), and the script passes only with that certificate."""

from __future__ import annotations

import ssl
import subprocess
import sys
import threading
from collections.abc import Iterator
from concurrent import futures
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from tests.helm.certs import CertFiles, make_cert
from tests.helm.helpers import of_kind

TLS = {"tls": {"enabled": True, "existingSecret": "kvray-tls"}}
# The name the certificates hold; the script dials 127.0.0.1.
PUBLIC_HOST = "kvray.example.com"


class _Endpoints:
    """A stand-in kvray: HTTP /health and /ready, and gRPC health, each switchable."""

    def __init__(self, tls: CertFiles | None = None) -> None:
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
        if tls is not None:
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            context.load_cert_chain(tls.cert, tls.key)
            self.http.socket = context.wrap_socket(self.http.socket, server_side=True)
        self.scheme = "http" if tls is None else "https"
        threading.Thread(target=self.http.serve_forever, daemon=True).start()
        self.health = health.HealthServicer()
        self.grpc = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.grpc)
        if tls is None:
            self.grpc_port = self.grpc.add_insecure_port("127.0.0.1:0")
        else:
            pair = (tls.key.read_bytes(), tls.cert.read_bytes())
            credentials = grpc.ssl_server_credentials([pair])
            self.grpc_port = self.grpc.add_secure_port("127.0.0.1:0", credentials)
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


@pytest.fixture(scope="module", params=["self-signed", "ca-issued"])
def tls_endpoints(request, tmp_path_factory) -> Iterator[tuple[_Endpoints, CertFiles]]:
    """Stand-ins over TLS; the Secret's tls.crt is the served leaf either way."""
    directory = tmp_path_factory.mktemp(request.param)
    files = make_cert(directory, PUBLIC_HOST, with_ca=request.param == "ca-issued")
    stand_in = _Endpoints(files)
    yield stand_in, files
    stand_in.close()


def _command(render, values) -> list[str]:
    (pod,) = of_kind(render(values), "Pod")
    command = pod["spec"]["containers"][0]["command"]
    assert command[:2] == ["python", "-c"]
    return command


@pytest.fixture(scope="module")
def script(render) -> str:
    return _command(render, None)[2]


def _run(
    script: str, endpoints: _Endpoints, cert: Path | None = None
) -> subprocess.CompletedProcess[str]:
    http_url = f"{endpoints.scheme}://127.0.0.1:{endpoints.http.server_address[1]}"
    grpc_target = f"127.0.0.1:{endpoints.grpc_port}"
    return subprocess.run(
        [sys.executable, "-c", script, http_url, grpc_target, *([str(cert)] if cert else [])],
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


def test_tls_smoke_test_runs_the_same_script_with_the_secrets_certificate(render):
    plain, tls = _command(render, None), _command(render, TLS)
    assert tls[2] == plain[2]
    assert tls[3].startswith("https://") and plain[3].startswith("http://")
    assert tls[5] == "/etc/kvray/tls/tls.crt" and len(plain) == 5


@pytest.mark.parametrize(
    ("ready_status", "grpc_serving", "passes"),
    [(200, True, True), (503, True, False), (200, False, False)],
)
def test_smoke_test_over_tls(script, tls_endpoints, ready_status, grpc_serving, passes):
    endpoints, files = tls_endpoints
    endpoints.ready_status = ready_status
    endpoints.set_grpc(grpc_serving)
    result = _run(script, endpoints, files.cert)
    assert (result.returncode == 0) is passes, result.stdout + result.stderr
    if passes:
        assert "SERVING" in result.stdout


def test_smoke_test_over_tls_refuses_another_certificate(script, tls_endpoints, tmp_path):
    """The servers must present the Secret's certificate: one they do not serve fails, for
    HTTP (checked first) and for gRPC."""
    endpoints, _ = tls_endpoints
    endpoints.ready_status = 200
    endpoints.set_grpc(True)
    other = make_cert(tmp_path, PUBLIC_HOST)
    result = _run(script, endpoints, other.cert)
    assert result.returncode != 0
    assert "CERTIFICATE_VERIFY_FAILED" in result.stderr, result.stderr


def test_smoke_test_over_tls_checks_grpc_certificate(script, tls_endpoints, tmp_path):
    """HTTP presenting the Secret's certificate is not enough: a gRPC server with another
    certificate fails the script."""
    endpoints, files = tls_endpoints
    other = _Endpoints(make_cert(tmp_path, PUBLIC_HOST))
    try:
        endpoints.ready_status = 200
        other.set_grpc(True)
        http_url = f"https://127.0.0.1:{endpoints.http.server_address[1]}"
        result = subprocess.run(
            [
                sys.executable,
                "-c",
                script,
                http_url,
                f"127.0.0.1:{other.grpc_port}",
                str(files.cert),
            ],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
    finally:
        other.close()
    assert result.returncode != 0
    assert "GET /ready: 200" in result.stdout  # HTTP passed; gRPC's certificate did not

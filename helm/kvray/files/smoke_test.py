"""kvray smoke test (the chart's `helm test` pod): HTTP /health and /ready, then gRPC health.

usage: python smoke_test.py HTTP_BASE_URL GRPC_TARGET [CERT_FILE]   (exit status 0 = serving)

CERT_FILE (with tls.enabled: the Secret's tls.crt): both servers must present a chain that
leads to it. The host name is not checked: the certificate names the public host, and this pod
dials the in-cluster Service names, which it need not hold.
"""

import socket
import ssl
import sys
import urllib.request
from urllib.parse import urlsplit

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

SERVICE = "kvray.v1.LLMService"
TIMEOUT_S = 10


def pinned_context(cert_file: str) -> ssl.SSLContext:
    """Trusts the given certificate itself (a leaf too, not only a root CA), any host name."""
    context = ssl.create_default_context(cafile=cert_file)
    context.check_hostname = False
    context.verify_flags |= ssl.VERIFY_X509_PARTIAL_CHAIN
    return context


def served_name(target: str, context: ssl.SSLContext) -> str:
    """A name the server's (verified) certificate holds: gRPC always checks the host name, so
    the channel asks for this one instead of the Service name it dials."""
    split = urlsplit("//" + target)
    with socket.create_connection((split.hostname, split.port), timeout=TIMEOUT_S) as sock:
        with context.wrap_socket(sock) as tls:
            cert = tls.getpeercert()
    sans = cert.get("subjectAltName", ())
    names = [value for kind, value in sans if kind == "DNS"]
    names += [value for rdn in cert.get("subject", ()) for key, value in rdn if key == "commonName"]
    names += [value for kind, value in sans if kind == "IP Address"]
    if not names:
        raise SystemExit(f"{target}: the certificate holds no name")
    return names[0]


def grpc_channel(target: str, cert_file: str | None) -> grpc.Channel:
    if cert_file is None:
        return grpc.insecure_channel(target)
    with open(cert_file, "rb") as f:
        credentials = grpc.ssl_channel_credentials(root_certificates=f.read())
    context = pinned_context(cert_file)
    context.set_alpn_protocols(["h2"])  # as a gRPC client offers it
    name = served_name(target, context)
    return grpc.secure_channel(target, credentials, [("grpc.ssl_target_name_override", name)])


def main(http_base: str, grpc_target: str, cert_file: str | None = None) -> int:
    context = pinned_context(cert_file) if cert_file else None
    for path in ("/health", "/ready"):
        # urlopen raises for any non-2xx answer (503 from /ready: no engine replica healthy).
        url = http_base.rstrip("/") + path
        with urllib.request.urlopen(url, timeout=TIMEOUT_S, context=context) as reply:
            print(f"GET {path}: {reply.status}")
    with grpc_channel(grpc_target, cert_file) as channel:
        request = health_pb2.HealthCheckRequest(service=SERVICE)
        reply = health_pb2_grpc.HealthStub(channel).Check(request, timeout=TIMEOUT_S)
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    print(f"grpc.health.v1 {SERVICE}: {status}")
    return 0 if reply.status == health_pb2.HealthCheckResponse.SERVING else 1


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:4]))

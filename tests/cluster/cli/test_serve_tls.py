"""`kvray serve --tls-cert/--tls-key`: HTTPS and gRPC over TLS with a self-signed certificate,
through the official openai client and a real grpcio client; plain text is refused."""

from __future__ import annotations

import datetime
import ipaddress
import signal
from pathlib import Path

import grpc
import httpx
import pytest

from cluster.grpc_api.client import KvrayClient
from tests.cluster.cli.serve_process import ServeProcess
from tests.cluster.serve_helpers import ServePorts, free_port


def _self_signed(directory: Path) -> tuple[Path, Path]:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
            ),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = directory / "tls.crt", directory / "tls.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return cert_path, key_path


@pytest.mark.slow
def test_https_and_grpc_over_tls(tmp_path: Path) -> None:
    import openai

    cert, key = _self_signed(tmp_path)
    ports = ServePorts(http=free_port(), grpc=free_port())
    flags = ("--tls-cert", str(cert), "--tls-key", str(key), "--num-replicas", "1")
    with ServeProcess(ports, *flags, local=True) as server:
        server.wait_for("Press Ctrl-C")  # the banner's last line
        assert f"https://127.0.0.1:{ports.http}/v1" in server.text
        base = f"https://127.0.0.1:{ports.http}"
        assert httpx.get(f"{base}/health", verify=str(cert), timeout=30).status_code == 200
        with pytest.raises(httpx.HTTPError):  # plain HTTP on the TLS port gets no answer
            httpx.get(f"http://127.0.0.1:{ports.http}/health", timeout=30)
        client = openai.OpenAI(
            base_url=f"{base}/v1",
            api_key="unused",
            max_retries=0,
            http_client=httpx.Client(verify=str(cert), timeout=120),
        )
        done = client.completions.create(model="kvray-demo", prompt="Hello", max_tokens=4)
        assert done.choices[0].finish_reason in ("stop", "length")

        credentials = grpc.ssl_channel_credentials(root_certificates=cert.read_bytes())
        with KvrayClient(f"127.0.0.1:{ports.grpc}", credentials=credentials, timeout=120) as kv:
            got = _generate_when_serving(kv)
        assert len(got.completions) == 1 and got.completions[0].token_ids
        with KvrayClient(f"127.0.0.1:{ports.grpc}", timeout=30) as plain:
            with pytest.raises(grpc.RpcError) as err:
                plain.generate("Hello", max_tokens=4, timeout=30)
            assert err.value.code() is grpc.StatusCode.UNAVAILABLE
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(timeout=300) == 0
    server.read_rest()
    assert "Traceback" not in server.text, server.text


def _generate_when_serving(kv: KvrayClient):  # noqa: ANN202
    """The gRPC ingress answers once LLMServer has (a hang guard, not a measurement)."""
    import time

    deadline = time.monotonic() + 300
    while True:
        try:
            return kv.generate("Hello", max_tokens=4)
        except grpc.RpcError as err:
            if err.code() is not grpc.StatusCode.UNAVAILABLE or time.monotonic() > deadline:
                raise
            time.sleep(1)

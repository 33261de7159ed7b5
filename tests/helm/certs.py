"""Throw-away certificates for the chart's TLS tests, made with `cryptography`: a self-signed
one, or a leaf issued by a CA, for a name that is not the address the client dials (as in a
cluster, where the certificate names the public host and the smoke test dials a Service)."""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class CertFiles:
    cert: Path  # the served chain (leaf first), as a kubernetes.io/tls Secret's tls.crt
    key: Path  # its private key, as tls.key
    ca: Path | None  # the issuing CA's certificate; None for a self-signed leaf


def make_cert(directory: Path, host: str, with_ca: bool = False) -> CertFiles:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.UTC)

    def build(subject: str, issuer: str, public_key, signing_key, ca: bool) -> x509.Certificate:
        builder = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
            .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, issuer)]))
            .public_key(public_key)
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
        )
        if not ca or subject == host:
            san = x509.SubjectAlternativeName([x509.DNSName(host)])
            builder = builder.add_extension(san, critical=False)
        return builder.sign(signing_key, hashes.SHA256())

    def pem(cert: x509.Certificate) -> bytes:
        return cert.public_bytes(serialization.Encoding.PEM)

    key = ec.generate_private_key(ec.SECP256R1())
    ca_path = None
    if with_ca:
        ca_key = ec.generate_private_key(ec.SECP256R1())
        ca_cert = build("kvray test CA", "kvray test CA", ca_key.public_key(), ca_key, ca=True)
        leaf = build(host, "kvray test CA", key.public_key(), ca_key, ca=False)
        ca_path = directory / "ca.crt"
        ca_path.write_bytes(pem(ca_cert))
    else:
        # Self-signed: its own issuer, and so a CA for itself.
        leaf = build(host, host, key.public_key(), key, ca=True)
    cert_path, key_path = directory / "tls.crt", directory / "tls.key"
    cert_path.write_bytes(pem(leaf))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return CertFiles(cert=cert_path, key=key_path, ca=ca_path)

"""The network section: TLS comes as a pair, the key's variable is a name."""

from __future__ import annotations

import pytest

from cluster.config.network import NetworkSettings


def test_tls_needs_both_files() -> None:
    assert not NetworkSettings().tls
    assert NetworkSettings(tls_cert_file="/c.pem", tls_key_file="/k.pem").tls
    with pytest.raises(ValueError, match=r"^tls_key_file must be set together with tls_cert_file"):
        NetworkSettings(tls_cert_file="/c.pem")


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"api_key_env": "not a var"}, "api_key_env"),
        ({"grpc_drain_s": -1.0}, "grpc_drain_s"),
        ({"grpc_max_message_bytes": 0}, "grpc_max_message_bytes"),
        ({"tls_cert_file": "", "tls_key_file": ""}, "tls_cert_file"),
    ],
)
def test_bad_values_name_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=rf"^{field} "):
        NetworkSettings(**kwargs)

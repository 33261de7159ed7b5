"""ServeConfig's tenant fields: their checks (a bad keys file fails the config, and so
build_app), their flags and help."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from cluster.cli.flags import add_serve_flags, config_from_flags
from cluster.config import ServeConfig


def _write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "keys.yaml"
    path.write_text(text)
    return str(path)


def test_a_bad_keys_file_fails_the_config_and_build_app(tmp_path: Path) -> None:
    from cluster.deploy.app import build_app

    path = _write(tmp_path, "keys:\n  - {key: a, tokens_per_s: -3}\n")
    with pytest.raises(ValueError, match=r"api_keys_file .*: keys\[0\]\.tokens_per_s"):
        ServeConfig.from_flat(api_keys_file=path)
    with pytest.raises(ValueError, match=r"keys\[0\]\.tokens_per_s"):
        build_app({"api_keys_file": path})


def test_a_good_keys_file_and_a_path_only_the_cluster_has(tmp_path: Path) -> None:
    good = _write(tmp_path, "keys:\n  - {key: a, name: acme}\n")
    assert ServeConfig.from_flat(api_keys_file=good).tenants.api_keys_file == good
    assert ServeConfig.from_flat(api_keys_file=good).tenants.keys_file_missing() is None
    # `kvray config` for a cluster: the file is read where the ingresses run.
    remote = ServeConfig.from_flat(api_keys_file="/etc/kvray/api-keys/keys.yaml")
    assert (
        remote.tenants.keys_file_missing()
        == "api_keys_file /etc/kvray/api-keys/keys.yaml: no such file"
    )
    assert ServeConfig().tenants.keys_file_missing() is None


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ({"api_keys_file": ""}, "api_keys_file must be a file path"),
        ({"tenant_header": "x tenant"}, "tenant_header must be a header name"),
        ({"tenant_header": "Authorization"}, "tenant_header must not be 'Authorization'"),
        ({"tenant_header": "x-tenant-bin"}, "tenant_header must not be"),
        ({"tenant_requests_per_s": 0}, "tenant_requests_per_s must be a number > 0"),
        ({"tenant_tokens_per_s": "many"}, "tenant_tokens_per_s must be a number > 0"),
        ({"tenant_tokens_per_s": True}, "tenant_tokens_per_s must be a number > 0"),
        (
            {"tenant_header": "x-tenant-id", "api_keys_file": "/k.yaml"},
            "tenant_header cannot be used with api_keys_file",
        ),
    ],
)
def test_bad_tenant_fields_name_themselves(args: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ServeConfig.from_args(args)


def test_flags_fill_the_fields(tmp_path: Path) -> None:
    path = _write(tmp_path, "keys:\n  - {key: a}\n")
    parser = argparse.ArgumentParser()
    add_serve_flags(parser, default_host="127.0.0.1")
    config = config_from_flags(
        parser.parse_args(["--tenant-requests-per-s", "2.5", "--tenant-tokens-per-s", "1000"])
    )
    assert (config.tenants.tenant_requests_per_s, config.tenants.tenant_tokens_per_s) == (
        2.5,
        1000.0,
    )
    config = config_from_flags(parser.parse_args(["--tenant-header", "x-tenant-id"]))
    assert config.tenants.tenant_header == "x-tenant-id"
    config = config_from_flags(parser.parse_args(["--api-keys-file", path]))
    assert config.tenants.api_keys_file == path
    help_text = " ".join(parser.format_help().split())
    for flag in ("--api-keys-file", "--tenant-header", "--tenant-requests-per-s"):
        assert flag in help_text
    assert "only as trustworthy as the proxy" in help_text

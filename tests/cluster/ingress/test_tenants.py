"""Tenants: from the keys file's keys, the single key, or a header; the check of a header's value
(a 400 naming it); the tenant bound per request task."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from cluster.config import ServeConfig
from cluster.config.keys_file import derived_name, parse_keys
from cluster.errors import AuthenticationError, InvalidRequestError
from cluster.ingress.auth import ApiKeyAuth
from cluster.ingress.tenants import TenantAuth, bind_tenant, current_tenant

KEYS = parse_keys(
    "keys:\n  - {key: sk-a1, name: acme}\n  - {key: sk-a2, name: acme}\n  - {key: sk-x}\n", "k"
)


def _bearer(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


def test_keys_of_the_file_and_the_single_key_name_their_tenants() -> None:
    auth = TenantAuth("sk-single", KEYS)
    assert auth.enabled
    for key, tenant in (
        ("sk-a1", "acme"),
        ("sk-a2", "acme"),
        ("sk-x", derived_name("sk-x")),
        ("sk-single", "default"),
    ):
        auth.check(f"Bearer {key}")
        assert auth.tenant(_bearer(key)) == tenant
    for bad in (None, "", "sk-a1", "Bearer wrong", "Basic sk-a1", "Bearer sk-a11"):
        with pytest.raises(AuthenticationError):
            auth.check(bad)
    auth.check_path("/health", None)
    with pytest.raises(AuthenticationError):
        auth.check_path("/v1/models", None)


def test_the_file_alone_turns_auth_on_and_nothing_turns_it_off() -> None:
    TenantAuth(None, KEYS).check("Bearer sk-a1")
    with pytest.raises(AuthenticationError, match="missing API key"):
        TenantAuth(None, KEYS).check(None)
    off = TenantAuth()
    assert not off.enabled
    off.check(None)
    assert off.tenant({}) == "default"


def test_from_config_reads_the_key_variable_and_the_file(tmp_path: Path) -> None:
    path = tmp_path / "keys.yaml"
    path.write_text("keys:\n  - {key: sk-b, name: beta}\n")
    config = ServeConfig.from_flat(api_keys_file=str(path), api_key_env="MY_KEY")
    auth = TenantAuth.from_config(config, {"MY_KEY": "sk-env"})
    assert auth.tenant(_bearer("sk-b")) == "beta"
    assert auth.tenant(_bearer("sk-env")) == "default"


def test_a_header_names_the_tenant_when_there_is_no_keys_file() -> None:
    auth = TenantAuth("sk-single", header="X-Tenant-Id")
    assert auth.tenant({"x-tenant-id": "team.42:eu@corp-a"}) == "team.42:eu@corp-a"
    assert auth.tenant({}) == "default"
    assert auth.tenant({"x-tenant-id": ""}) == "default"
    for bad in ("has space", "x" * 65, "naïve", "a/b"):
        with pytest.raises(InvalidRequestError) as err:
            auth.tenant({"x-tenant-id": bad})
        assert err.value.param == "x-tenant-id"
        assert err.value.message.startswith("x-tenant-id must be 1 to 64 characters")
        assert err.value.http_status == 400


def test_bind_tenant_is_per_task() -> None:
    auth = TenantAuth(header="x-tenant-id")

    async def serve(name: str) -> str:
        bind_tenant(auth, "/v1/completions", {"x-tenant-id": name})
        await asyncio.sleep(0)  # the other request's task runs in between
        return current_tenant()

    async def both() -> list[str]:
        return list(await asyncio.gather(serve("a"), serve("b")))

    assert asyncio.run(both()) == ["a", "b"]
    assert current_tenant() == "default"  # this task never bound one


def test_probes_and_a_plain_key_check_name_no_tenant() -> None:
    auth = TenantAuth(header="x-tenant-id")

    async def probe() -> str:
        return bind_tenant(auth, "/ready", {"x-tenant-id": "not a name"})

    assert asyncio.run(probe()) == "default"

    async def plain() -> str:
        return bind_tenant(ApiKeyAuth("k"), "/v1/completions", {"x-tenant-id": "a"})

    assert asyncio.run(plain()) == "default"

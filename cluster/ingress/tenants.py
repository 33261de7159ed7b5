"""Who sent a request: its tenant, named from its API key, or from a header, or "default".

- `--api-keys-file` (cluster/config/keys_file.py): each key names its tenant; the key of
  `--api-key` / its env var is tenant "default". Any key of either is a valid key.
- `--tenant-header NAME` (without a keys file): the header's value names the tenant, checked
  (1 to 64 characters of letters, digits and . _ - : @; else 400 naming the header). A header
  is only as trustworthy as the proxy in front of kvray that sets it: a client that reaches
  kvray directly can name any tenant.
- Otherwise, and for requests without the header, the tenant is "default".

`TenantAuth` is the ingresses' API-key check (an `ApiKeyAuth` that knows many keys) and names
the tenant. The guard (HTTP, cluster/http/guard.py) and the servicer (gRPC) call `bind_tenant`
once per request; the routes' preparation reads it with `current_tenant()`. It is a
ContextVar: each request's task (and the tasks it starts) sees its own value.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from contextvars import ContextVar
from typing import TYPE_CHECKING

from cluster.config.keys_file import DEFAULT_TENANT, KeysFile, key_digest, load_keys_file
from cluster.errors import AuthenticationError, InvalidRequestError
from cluster.ingress.auth import OPEN_PATHS, ApiKeyAuth

if TYPE_CHECKING:
    from cluster.config import ServeConfig

HEADER_VALUE = re.compile(r"[A-Za-z0-9._:@-]{1,64}")
HEADER_VALUE_RULE = "1 to 64 characters of letters, digits and . _ - : @"

_TENANT: ContextVar[str] = ContextVar("kvray_tenant", default=DEFAULT_TENANT)


def current_tenant() -> str:
    """The tenant of the request this task serves ("default" outside one)."""
    return _TENANT.get()


class TenantAuth(ApiKeyAuth):
    """The API-key check of an ingress (the single key and the keys file's), and the tenant
    each request belongs to (module doc)."""

    def __init__(
        self,
        key: str | None = None,
        keys: KeysFile | None = None,
        header: str | None = None,
    ) -> None:
        super().__init__(key)
        self._tenants: dict[str, str] = {} if key is None else {key_digest(key): DEFAULT_TENANT}
        if keys is not None:
            self._tenants |= dict(keys.tenant_of_digest)  # the file wins for a key in both
        self.keys = keys
        self.header = header.lower() if header else None

    @staticmethod
    def from_config(config: ServeConfig, environ: Mapping[str, str] | None = None) -> TenantAuth:
        """From a ServeConfig: the key in its env var (read now, on the ingress's node), the
        keys file (read now: a bad one fails the ingress's start), the tenant header."""
        env = os.environ if environ is None else environ
        path = config.tenants.api_keys_file
        return TenantAuth(
            env.get(config.network.api_key_env) or None,
            load_keys_file(path) if path else None,
            config.tenants.tenant_header,
        )

    @property
    def enabled(self) -> bool:
        return bool(self._tenants)

    def check(self, authorization: str | None) -> None:
        """Raises AuthenticationError unless `authorization` is "Bearer <a known key>"."""
        if not self._tenants:
            return
        if not authorization:
            raise AuthenticationError("missing API key: send 'Authorization: Bearer <key>'")
        if self._key_tenant(authorization) is None:
            raise AuthenticationError("invalid API key")

    def tenant(self, headers: Mapping[str, str]) -> str:
        """The tenant of a request whose key passed `check`; `headers` lower-case names.
        Raises InvalidRequestError naming the tenant header when its value is not a name."""
        if self.keys is not None:
            return self._key_tenant(headers.get("authorization")) or DEFAULT_TENANT
        if self.header is None:
            return DEFAULT_TENANT
        value = headers.get(self.header)
        if not value:
            return DEFAULT_TENANT
        if not HEADER_VALUE.fullmatch(value):
            shown = value if len(value) <= 80 else value[:80] + "..."
            raise InvalidRequestError(
                self.header, f"{self.header} must be {HEADER_VALUE_RULE}, got {shown!r}"
            )
        return value

    def _key_tenant(self, authorization: str | None) -> str | None:
        if not authorization:
            return None
        scheme, _, token = authorization.partition(" ")
        if scheme.lower() != "bearer":
            return None
        # A dict lookup by digest: its timing says nothing about any key.
        return self._tenants.get(key_digest(token.strip()))


def bind_tenant(auth: ApiKeyAuth, path: str | None, headers: Mapping[str, str]) -> str:
    """Names the tenant of the request this task serves (after `auth.check`), for
    `current_tenant()`; the probes' paths (/health, /ready) are "default". A plain
    ApiKeyAuth names no tenants: "default"."""
    tenant = DEFAULT_TENANT
    if isinstance(auth, TenantAuth) and path not in OPEN_PATHS:
        tenant = auth.tenant(headers)
    _TENANT.set(tenant)
    return tenant

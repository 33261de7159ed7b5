"""API-key check for the ingresses: `Authorization: Bearer KEY` (HTTP) / `authorization` metadata.

Over HTTP the key may also come as `x-api-key: KEY` (how Anthropic's clients send it):
`with_api_key` reads it as the bearer token when there is no Authorization header.

The key lives in an environment variable on the cluster (ServeConfig.network.api_key_env, default
KVRAY_API_KEY), read when the ingress replica starts; it never appears in a config file.
An unset or empty variable turns auth off.
"""

from __future__ import annotations

import hmac
import os
from collections.abc import Mapping

from cluster.errors import AuthenticationError

# Liveness and readiness probes (kubelet, load balancers) carry no credentials.
OPEN_PATHS = frozenset({"/health", "/ready"})


API_KEY_HEADER = "x-api-key"


def with_api_key(headers: dict[str, str]) -> dict[str, str]:
    """`headers` (lower-case names) with `x-api-key: KEY` read as `authorization: Bearer
    KEY` when no Authorization header is sent (an Authorization header wins)."""
    key = headers.get(API_KEY_HEADER)
    if key and not headers.get("authorization"):
        return {**headers, "authorization": f"Bearer {key.strip()}"}
    return headers


class ApiKeyAuth:
    """Checks bearer tokens against one key; `enabled` is False when there is no key."""

    def __init__(self, key: str | None) -> None:
        self._key = key.encode() if key else None

    @staticmethod
    def from_env(var: str, environ: Mapping[str, str] | None = None) -> ApiKeyAuth:
        env = os.environ if environ is None else environ
        return ApiKeyAuth(env.get(var) or None)

    @property
    def enabled(self) -> bool:
        return self._key is not None

    def check(self, authorization: str | None) -> None:
        """Raises AuthenticationError unless `authorization` is "Bearer <the key>"."""
        if self._key is None:
            return
        if not authorization:
            raise AuthenticationError("missing API key: send 'Authorization: Bearer <key>'")
        scheme, _, token = authorization.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self._key):
            raise AuthenticationError("invalid API key")

    def check_path(self, path: str, authorization: str | None) -> None:
        if path not in OPEN_PATHS:
            self.check(authorization)

"""The tenants section: API keys naming tenants, a header naming them, and each tenant's
default quotas (docs/serving.md#tenants-and-quotas).

A tenant is who sent a request: the tenant an API key of `api_keys_file` names, else the
value of the `tenant_header` header, else "default". Quotas are per tenant, enforced by the
ingresses (cluster/ingress/quotas.py); the engines take tenants in turn.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from cluster.config.keys_file import load_keys_file
from cluster.config.setting import NETWORK_GROUP, setting

# HTTP header names are case-insensitive and gRPC metadata keys lower case: checked in lower
# case. Not a header that already means something to kvray or to gRPC.
HEADER_PATTERN = re.compile(r"[a-z0-9][a-z0-9-]{0,63}")
RESERVED_HEADERS = frozenset({"authorization", "content-type", "content-length", "host", "te"})


@dataclass(frozen=True)
class TenantSettings:
    """Who sent a request, and how much each tenant may use."""

    api_keys_file: str | None = setting(
        None,
        "YAML or JSON file of API keys, each naming its tenant and optional quotas "
        "(requests_per_s, tokens_per_s, bursts); read where the ingresses run. --api-key "
        "still works, as tenant 'default' (default: none)",
        NETWORK_GROUP,
        kind="path",
    )
    tenant_header: str | None = setting(
        None,
        "header (gRPC metadata) whose value names a request's tenant, e.g. x-tenant-id; "
        "only as trustworthy as the proxy that sets it; not with --api-keys-file "
        "(default: none: every request without a key of the file is tenant 'default')",
        NETWORK_GROUP,
    )
    tenant_requests_per_s: float | None = setting(
        None,
        "requests per second each tenant may send (HTTP 429 past it), unless the keys file "
        "gives it a rate of its own (default: no limit)",
        NETWORK_GROUP,
    )
    tenant_tokens_per_s: float | None = setting(
        None,
        "tokens per second each tenant may use: prompt + max_tokens x n, charged on admission "
        "and the unused part given back at the end; unless the keys file gives it a rate of its "
        "own (default: no limit)",
        NETWORK_GROUP,
    )

    def __post_init__(self) -> None:
        """The keys file is read when it is on this machine (kvray serve, and the cluster
        building the app); a path only the cluster has is read there, by the ingresses, which
        then fail to start on a bad file."""
        path = self.api_keys_file
        if path is not None:
            if not isinstance(path, str) or not path:
                raise ValueError(f"api_keys_file must be a file path or null, got {path!r}")
            if os.path.exists(path):
                load_keys_file(path)
        header = self.tenant_header
        if header is not None:
            if not isinstance(header, str) or not HEADER_PATTERN.fullmatch(header.lower()):
                raise ValueError(
                    "tenant_header must be a header name (letters, digits and '-', at most 64), "
                    f"got {header!r}"
                )
            if header.lower() in RESERVED_HEADERS or header.lower().endswith("-bin"):
                raise ValueError(f"tenant_header must not be {header!r}: it means something else")
            if path is not None:
                raise ValueError(
                    "tenant_header cannot be used with api_keys_file: each key of the file "
                    "names its tenant"
                )
        for name in ("tenant_requests_per_s", "tenant_tokens_per_s"):
            v = getattr(self, name)
            ok = isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v < float("inf")
            if v is not None and not ok:
                raise ValueError(f"{name} must be a number > 0 or null, got {v!r}")

    def keys_file_missing(self) -> str | None:
        """What is wrong with a keys file that must be on this machine (kvray serve on a
        local Ray): None when there is none or it exists (its content was checked when the
        section was built)."""
        path = self.api_keys_file
        if path is None or os.path.isfile(path):
            return None
        return f"api_keys_file {path}: no such file"

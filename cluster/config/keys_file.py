"""The API-keys file (`--api-keys-file`, ServeConfig.api_keys_file): who may call, as which
tenant, at what rate.

A YAML or JSON document with one field, `keys`, a list of entries:

    keys:
      - key: sk-acme-1f3a9c            # what the client sends: Authorization: Bearer <key>
        name: acme                     # its tenant (default: "key-" + 8 hex of its sha256)
        requests_per_s: 5              # optional quotas of the tenant, token buckets that
        tokens_per_s: 2000             #   hold one second's worth unless a burst is given
        requests_burst: 10
        tokens_burst: 8000
      - key: sk-acme-77d0e2            # a second key of acme: it shares acme's quota
        name: acme

Several keys may name one tenant; its quota fields may be written on any of them, and two keys
giving one field different values is an error. A tenant named `default` is the tenant of the
single key (`--api-key`) and of requests that name none: its entry sets their quota.

Read once, where it is checked (ServeConfig's check, `kvray serve`) and where it is used
(each ingress replica at start-up). Every problem is a ValueError naming the file and the
field (`keys[2].tokens_per_s`), so a bad file stops the deployment before anything serves.
Keys are kept only as their sha256 digests.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

# Tenant names appear in metric labels and error messages: short, plain characters.
NAME_PATTERN = re.compile(r"[A-Za-z0-9._-]{1,64}")
NAME_RULE = "1 to 64 characters of letters, digits, '.', '_' and '-'"
# The metric label of header tenants beyond the labelled ones (cluster/ingress/tenant_metrics.py).
OTHER_TENANT = "other"
DEFAULT_TENANT = "default"
# An API key travels in a header: printable ASCII without spaces.
KEY_PATTERN = re.compile(r"[\x21-\x7e]+")


@dataclass(frozen=True)
class Quota:
    """A tenant's rates (per second) and bucket sizes; None: no limit on that rate (a burst of
    None holds one second's worth of its rate)."""

    requests_per_s: float | None = None
    tokens_per_s: float | None = None
    requests_burst: float | None = None
    tokens_burst: float | None = None

    def merged(self, fallback: Quota) -> Quota:
        """This quota, with each rate it leaves unset (and that rate's burst) from `fallback`."""
        req = (self.requests_per_s, self.requests_burst)
        tok = (self.tokens_per_s, self.tokens_burst)
        if req[0] is None:
            req = (fallback.requests_per_s, fallback.requests_burst)
        if tok[0] is None:
            tok = (fallback.tokens_per_s, fallback.tokens_burst)
        return Quota(req[0], tok[0], req[1], tok[1])


QUOTA_FIELDS = tuple(f.name for f in fields(Quota))
ENTRY_FIELDS = ("key", "name", *QUOTA_FIELDS)


@dataclass(frozen=True)
class KeysFile:
    """A parsed keys file: key digests to tenants, and each tenant's quota (file order)."""

    path: str
    tenant_of_digest: Mapping[str, str] = field(default_factory=dict)
    quotas: Mapping[str, Quota] = field(default_factory=dict)

    @property
    def tenants(self) -> tuple[str, ...]:
        return tuple(self.quotas)


def key_digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def derived_name(key: str) -> str:
    """The tenant of a key without a name: short, stable, and says nothing of the key."""
    return "key-" + key_digest(key)[:8]


def load_keys_file(path: str) -> KeysFile:
    """Reads and checks the file; ValueError naming the file and the field."""
    try:
        text = Path(path).read_text()
    except OSError as err:
        raise ValueError(f"api_keys_file {path}: cannot be read: {err}") from None
    return parse_keys(text, path)


def parse_keys(text: str, path: str) -> KeysFile:
    def bad(where: str, why: str) -> ValueError:
        return ValueError(f"api_keys_file {path}: {where} {why}")

    doc = _parse_document(text, path)
    if not isinstance(doc, Mapping):
        raise bad("the document", "must be a mapping with a `keys` list")
    unknown = sorted(str(k) for k in doc if k != "keys")
    if unknown:
        raise bad(unknown[0], "is not a known field (the file has one field: keys)")
    entries = doc.get("keys")
    if not isinstance(entries, list) or not entries:
        raise bad("keys", "must be a non-empty list of {key, name, quotas} entries")
    digests: dict[str, tuple[str, int]] = {}  # digest -> (tenant, index)
    given: dict[str, dict[str, tuple[float, int]]] = {}  # tenant -> field -> (value, index)
    for i, entry in enumerate(entries):
        where = f"keys[{i}]"
        if not isinstance(entry, Mapping):
            raise bad(where, "must be a mapping with at least `key`")
        for name in entry:
            if name not in ENTRY_FIELDS:
                raise bad(
                    f"{where}.{name}", f"is not a known field; known: {', '.join(ENTRY_FIELDS)}"
                )
        key = entry.get("key")
        if not isinstance(key, str) or not KEY_PATTERN.fullmatch(key):
            raise bad(f"{where}.key", "must be a non-empty string of printable ASCII, no spaces")
        digest = key_digest(key)
        if digest in digests:
            raise bad(f"{where}.key", f"repeats the key of keys[{digests[digest][1]}]")
        tenant = entry.get("name", derived_name(key))
        if not isinstance(tenant, str) or not NAME_PATTERN.fullmatch(tenant):
            raise bad(f"{where}.name", f"must be {NAME_RULE}, got {tenant!r}")
        if tenant == OTHER_TENANT:
            raise bad(f"{where}.name", f"{OTHER_TENANT!r} is reserved (the metrics' overflow)")
        digests[digest] = (tenant, i)
        quota = given.setdefault(tenant, {})
        for name in QUOTA_FIELDS:
            if name not in entry:
                continue
            value = entry[name]
            if not _is_rate(value):
                raise bad(f"{where}.{name}", f"must be a number > 0, got {value!r}")
            earlier = quota.get(name)
            if earlier is not None and earlier[0] != value:
                raise bad(
                    f"{where}.{name}",
                    f"is {value!r} but keys[{earlier[1]}] gives tenant {tenant!r} {earlier[0]!r}",
                )
            quota[name] = (float(value), i)
    quotas = {}
    for tenant, values in given.items():
        for kind in ("requests", "tokens"):
            if f"{kind}_burst" in values and f"{kind}_per_s" not in values:
                index = values[f"{kind}_burst"][1]
                raise bad(f"keys[{index}].{kind}_burst", f"needs {kind}_per_s for {tenant!r}")
        quotas[tenant] = Quota(**{name: v for name, (v, _) in values.items()})
    return KeysFile(path, {d: t for d, (t, _) in digests.items()}, quotas)


def _parse_document(text: str, path: str) -> Any:
    try:
        if path.endswith(".json"):
            return json.loads(text)
        import yaml

        return yaml.safe_load(text)
    except Exception as err:  # json.JSONDecodeError, yaml.YAMLError: say where it broke
        where = " ".join(str(err).split())  # one line: the parser's message spans several
        raise ValueError(f"api_keys_file {path}: not valid YAML or JSON: {where}") from None


def _is_rate(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0

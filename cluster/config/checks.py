"""The checks the config sections share: each bad field is a ValueError naming it (its YAML
key; the flag is the same with dashes), raised when the section is built, at the edge (flags,
a YAML's `args`), never later on the cluster."""

from __future__ import annotations

import math
from typing import Any
from urllib.parse import urlsplit


def need(ok: bool, name: str, why: str, value: Any) -> None:
    """ValueError "NAME WHY, got VALUE" unless `ok`."""
    if not ok:
        raise ValueError(f"{name} {why}, got {value!r}")


def is_int(v: object) -> bool:
    """An int, not a bool."""
    return isinstance(v, int) and not isinstance(v, bool)


def is_num(v: object) -> bool:
    """A finite int or float, not a bool."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def need_positive_ints(section: object, *names: str) -> None:
    """Each of `names` an integer >= 1."""
    for name in names:
        v = getattr(section, name)
        need(is_int(v) and v >= 1, name, "must be an integer >= 1", v)


def need_bools(section: object, *names: str) -> None:
    for name in names:
        v = getattr(section, name)
        need(isinstance(v, bool), name, "must be a boolean", v)


def need_choice(section: object, name: str, choices: tuple[str, ...]) -> None:
    v = getattr(section, name)
    need(v in choices, name, f"must be one of {', '.join(choices)}", v)


def is_http_url(v: str) -> bool:
    """An http(s) URL with a host (where the OTLP exporter can POST)."""
    parts = urlsplit(v)
    return parts.scheme in ("http", "https") and bool(parts.netloc)

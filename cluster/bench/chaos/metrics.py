"""The migrations a `kvray bench serve --chaos` run caused, from the routers' own counter.

The ingresses count every request they move to another replica in
`kvray_request_migrations_total{cause}` (cluster/routing/metrics.py), exported through Ray's
metrics agent on every node (`ray_` prefixed). The bench reads it from each node's export port
before and after the run: the difference is this run's migrations (other apps on the same
cluster move requests too, so a quiet cluster is assumed). Ray's agents report every
`metrics_report_interval_ms` (10 s by default), hence `--chaos-metrics-wait-s` before the last
read.
"""

from __future__ import annotations

import asyncio
import re
import urllib.request

MIGRATIONS = "kvray_request_migrations_total"
_SAMPLE = re.compile(r"^(?:ray_)?(?P<name>[a-zA-Z_:][\w:]*)(?:\{(?P<labels>.*)\})?\s+(?P<v>\S+)")
_CAUSE = re.compile(r'(?:^|,)\s*cause="(?P<cause>[^"]*)"')
SCRAPE_TIMEOUT_S = 10.0


def metrics_urls() -> list[str]:
    """Every live node's Prometheus endpoint (Ray's metrics export port); [] without Ray."""
    import ray

    if not ray.is_initialized():
        return []
    return [
        f"http://{n['NodeManagerAddress']}:{n['MetricsExportPort']}/metrics"
        for n in ray.nodes()
        if n.get("Alive") and n.get("MetricsExportPort")
    ]


def counter_by_cause(text: str, name: str = MIGRATIONS) -> dict[str, float]:
    """The samples of counter `name` (with or without Ray's prefix) in a Prometheus text
    page, summed by their `cause` label."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if m is None or m["name"] != name:
            continue
        cause = _CAUSE.search(m["labels"] or "")
        key = cause["cause"] if cause else ""
        out[key] = out.get(key, 0.0) + float(m["v"])
    return out


def _read(urls: list[str]) -> dict[str, float] | None:
    total: dict[str, float] = {}
    try:
        for url in urls:
            with urllib.request.urlopen(url, timeout=SCRAPE_TIMEOUT_S) as resp:
                page = resp.read().decode()
            for cause, v in counter_by_cause(page).items():
                total[cause] = total.get(cause, 0.0) + v
    except OSError:
        return None
    return total


async def read_migrations(urls: list[str]) -> dict[str, float] | None:
    """The migrations counted so far on `urls`, by cause; None when unreadable (no Ray, no
    export port)."""
    if not urls:
        return None
    return await asyncio.to_thread(_read, urls)


def migrations_between(
    before: dict[str, float] | None, after: dict[str, float] | None
) -> dict[str, int] | None:
    """after - before, by cause (causes with none left out); None when either is unknown."""
    if before is None or after is None:
        return None
    return {
        cause: round(v - before.get(cause, 0.0))
        for cause, v in sorted(after.items())
        if v - before.get(cause, 0.0) > 0
    }

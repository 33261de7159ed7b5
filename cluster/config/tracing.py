"""The tracing section: OpenTelemetry traces over OTLP/HTTP (cluster/tracing.py,
docs/serving.md#tracing); off, the default, costs nothing."""

from __future__ import annotations

from dataclasses import dataclass

from cluster.config.checks import is_http_url, is_num, need
from cluster.config.setting import NETWORK_GROUP, setting


@dataclass(frozen=True)
class TracingSettings:
    """Where traces go and how many are kept."""

    otlp_endpoint: str | None = setting(
        None,
        "export traces over OTLP/HTTP to this URL, e.g. http://collector:4318 (/v1/traces is "
        "added when the URL has no path); needs pip install 'kvray[otel]' (default: off)",
        NETWORK_GROUP,
    )
    otlp_sample_ratio: float = setting(
        1.0, "fraction of new traces kept; an incoming traceparent decides", NETWORK_GROUP
    )

    def __post_init__(self) -> None:
        e = self.otlp_endpoint
        need(
            e is None or (isinstance(e, str) and is_http_url(e)),
            "otlp_endpoint",
            "must be an http:// or https:// URL or null",
            e,
        )
        r = self.otlp_sample_ratio
        need(is_num(r) and 0 <= r <= 1, "otlp_sample_ratio", "must be a number in [0, 1]", r)

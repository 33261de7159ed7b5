"""The dashboard's row about tenants: who sends what, who is refused, who waits.

The tenant label's values are bounded by the ingresses (the keys file's tenants, "default",
the first header tenants each ingress sees, then "other"), so grouping by it stays cheap.
"""

from __future__ import annotations

from dashboard_panels import Panel, Row, Target, quantiles, rate

TENANT_ROWS: tuple[Row, ...] = (
    Row(
        "Tenants",
        (
            Panel(
                "Requests by tenant",
                "API requests per second admitted past each tenant's quotas, HTTP and gRPC.",
                (Target(rate("ray_kvray_tenant_requests_total", by="tenant"), "{{tenant}}"),),
                unit="reqps",
                width=6,
            ),
            Panel(
                "Tokens by tenant",
                "Prompt and generated tokens per second by tenant, counted when each engine "
                "request ends: what the token quotas are measured against.",
                (Target(rate("ray_kvray_tenant_tokens_total", by="tenant"), "{{tenant}}"),),
                width=6,
            ),
            Panel(
                "Rejections by tenant",
                "Requests refused per second by tenant and reason: quota_requests and "
                "quota_tokens (its quotas at the ingress, 429), queue_full (an engine replica's "
                "queue, full and the tenant over its share of it).",
                (
                    Target(
                        rate("ray_kvray_tenant_rejected_total", by="tenant, reason"),
                        "{{tenant}} {{reason}}",
                    ),
                ),
                unit="reqps",
                width=6,
            ),
            Panel(
                "Queue time p99 by tenant",
                "99th percentile time from arrival at an engine to first scheduled, by tenant: "
                "with fair ordering, one tenant's burst raises its own, not the others'.",
                quantiles("ray_kvray_tenant_queue_time_seconds", "", (0.99,), by="tenant"),
                unit="s",
                width=6,
            ),
        ),
    ),
)

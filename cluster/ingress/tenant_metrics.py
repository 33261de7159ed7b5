"""Per-tenant Prometheus metrics of an ingress replica (names and labels: monitoring/README.md).

The `tenant` label has bounded values: the keys file's tenants and "default", created at 0
when the ingress starts, and the first MAX_HEADER_TENANTS other tenants (header tenants) this
replica sees; later ones are counted as "other". Different ingress replicas may label
different header tenants.

`ray` is imported inside the constructor, as in cluster/routing/metrics.py.
"""

from __future__ import annotations

from collections.abc import Iterable

from cluster.config.keys_file import DEFAULT_TENANT, OTHER_TENANT
from cluster.ray_internals import record_zero

MAX_HEADER_TENANTS = 50
# Why a request of a tenant was refused: its quotas at the ingress, a full replica queue.
TENANT_REJECT_REASONS = ("quota_requests", "quota_tokens", "queue_full")
# Arrival at the engine to first scheduled: as kvray_request_queue_time_seconds.
TENANT_QUEUE_BUCKETS_S: tuple[float, ...] = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
    20.0, 40.0, 80.0, 160.0, 320.0, 640.0,
)  # fmt: skip


class TenantLabels:
    """tenant -> its label value (module doc)."""

    def __init__(self, named: Iterable[str], max_others: int = MAX_HEADER_TENANTS) -> None:
        self.named = frozenset(named) | {DEFAULT_TENANT}
        self._others: set[str] = set()
        self._max_others = max_others

    def __call__(self, tenant: str) -> str:
        if tenant in self.named or tenant in self._others:
            return tenant
        if len(self._others) < self._max_others:
            self._others.add(tenant)
            return tenant
        return OTHER_TENANT


class TenantMetrics:
    """Requests, tokens, rejections and queue time by tenant (one instance per ingress)."""

    def __init__(self, named: Iterable[str] = ()) -> None:
        from ray.util.metrics import Counter, Histogram

        self.label = TenantLabels(named)
        self._requests = Counter(
            "kvray_tenant_requests_total",
            "API requests admitted past the tenant's quotas, by tenant.",
            tag_keys=("tenant",),
        )
        self._tokens = Counter(
            "kvray_tenant_tokens_total",
            "Prompt and generated tokens of finished engine requests, by tenant.",
            tag_keys=("tenant",),
        )
        self._rejected = Counter(
            "kvray_tenant_rejected_total",
            "Requests refused by tenant and reason: quota_requests, quota_tokens (its quotas "
            "at the ingress), queue_full (an engine replica's waiting queue).",
            tag_keys=("tenant", "reason"),
        )
        self._queue = Histogram(
            "kvray_tenant_queue_time_seconds",
            "Arrival at the engine to first scheduled, by tenant.",
            boundaries=list(TENANT_QUEUE_BUCKETS_S),
            tag_keys=("tenant",),
        )
        self._zeroed: set[str] = set()
        for tenant in sorted(self.label.named):
            self._tag(tenant)

    def admitted(self, tenant: str) -> None:
        self._requests.inc(tags=self._tag(tenant))

    def tokens(self, tenant: str, count: int) -> None:
        if count > 0:
            self._tokens.inc(count, tags=self._tag(tenant))

    def rejected(self, tenant: str, reason: str) -> None:
        self._rejected.inc(tags={**self._tag(tenant), "reason": reason})

    def queue_time(self, tenant: str, seconds: float) -> None:
        self._queue.observe(max(0.0, seconds), tags=self._tag(tenant))

    def _tag(self, tenant: str) -> dict[str, str]:
        """The tenant's label; its counters start at 0 the first time it is seen, so rate()
        counts the first request of a new header tenant too."""
        label = self.label(tenant)
        if label not in self._zeroed:
            self._zeroed.add(label)
            record_zero(self._requests, {"tenant": label})
            record_zero(self._tokens, {"tenant": label})
            for reason in TENANT_REJECT_REASONS:
                record_zero(self._rejected, {"tenant": label, "reason": reason})
        return {"tenant": label}

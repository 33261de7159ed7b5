"""Prometheus metrics of the ingresses and the request router, exported through Ray's metrics
agent (one instance per ingress process: the router runs in its deployment handle). Names and
labels: monitoring/README.md; the engine replicas' metrics are in cluster/replica/metrics.py.

`ray` is imported inside the constructor: this module sits under `kvray --help`'s imports.
"""

from __future__ import annotations

from typing import Any

from cluster.errors import MIGRATION_CAUSES
from cluster.ray_internals import record_zero
from cluster.routing.lora_policy import LORA_DECISIONS

# Failure to the next token of a migrated request: a re-prefill on a warm replica takes
# milliseconds; waiting for a replacement replica (none left alive) takes tens of seconds.
MIGRATION_RESUME_BUCKETS_S: tuple[float, ...] = (
    0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0,
)  # fmt: skip

# Label values created at 0 up front (record_zero): the routing decisions (docs/contracts.md)
# and the rejection reasons the ingresses use.
ROUTING_DECISIONS = ("affinity", "load", "fallback")
REJECT_REASONS = ("queue_full", "queue_timeout", "unauthenticated")
# What a checked request asks of the engines (`request_kind`), per protocol.
REQUEST_KINDS = ("generation", "embedding", "scoring")
PROTOCOLS = ("http", "grpc")
# Answers the alert rules compute ratios from (success, overload, server error), per protocol:
# HTTP status codes and gRPC status names.
ALERTING_CODES = {
    "http": ("200", "429", "500", "503"),
    "grpc": ("OK", "RESOURCE_EXHAUSTED", "INTERNAL", "UNAVAILABLE"),
}


class RouterMetrics:
    """Metrics of the ingresses and the request router (one instance per process)."""

    def __init__(self) -> None:
        from ray.util.metrics import Counter, Histogram

        self._requests = Counter(
            "kvray_router_requests_total",
            "Requests answered by the ingresses, by protocol and status code.",
            tag_keys=("protocol", "code"),
        )
        self._routing = Counter(
            "kvray_router_routing_total",
            "Routing decisions: affinity (prefix-preferred replica), load, fallback.",
            tag_keys=("decision",),
        )
        self._lora_routing = Counter(
            "kvray_router_lora_routing_total",
            "Routing of LoRA requests: held (to a replica holding the adapter), cold (no "
            "replica held it), spread (its holders were saturated).",
            tag_keys=("decision",),
        )
        self._rejected = Counter(
            "kvray_router_rejected_total",
            "Requests rejected before reaching an engine, by reason.",
            tag_keys=("reason",),
        )
        self._kinds = Counter(
            "kvray_router_requests_by_kind_total",
            "API requests checked and sent to the engines, by protocol and kind "
            "(generation, embedding, scoring); one per request, however many prompts it has.",
            tag_keys=("protocol", "kind"),
        )
        self._migrations = Counter(
            "kvray_request_migrations_total",
            "Requests moved to another replica because theirs died, by cause.",
            tag_keys=("cause",),
        )
        self._migration_resume = Histogram(
            "kvray_migration_resume_seconds",
            "Time from a replica failure to the migrated request's next token.",
            boundaries=list(MIGRATION_RESUME_BUCKETS_S),
            tag_keys=(),
        )
        for cause in MIGRATION_CAUSES:
            record_zero(self._migrations, {"cause": cause})
        for decision in ROUTING_DECISIONS:
            record_zero(self._routing, {"decision": decision})
        for decision in LORA_DECISIONS:
            record_zero(self._lora_routing, {"decision": decision})
        for reason in REJECT_REASONS:
            record_zero(self._rejected, {"reason": reason})
        for protocol, codes in ALERTING_CODES.items():
            for code in codes:
                record_zero(self._requests, {"protocol": protocol, "code": code})
        for protocol in PROTOCOLS:
            for kind in REQUEST_KINDS:
                record_zero(self._kinds, {"protocol": protocol, "kind": kind})

    def request(self, protocol: str, code: str) -> None:
        self._requests.inc(tags={"protocol": protocol, "code": str(code)})

    def checked(self, protocol: str, params: Any) -> None:
        """A request passed the ingress's checks; `params`: its SamplingParams."""
        self._kinds.inc(tags={"protocol": protocol, "kind": request_kind(params)})

    def routing(self, decision: str) -> None:
        self._routing.inc(tags={"decision": decision})

    def lora_routing(self, decision: str) -> None:
        self._lora_routing.inc(tags={"decision": decision})

    def rejected(self, reason: str) -> None:
        self._rejected.inc(tags={"reason": reason})

    def migration(self, cause: str) -> None:
        self._migrations.inc(tags={"cause": cause})

    def migration_resumed(self, seconds: float) -> None:
        self._migration_resume.observe(seconds)


def request_kind(params: Any) -> str:
    """What a request's SamplingParams ask of the engine: an embedding (pooling), scoring
    (the prompt's own logprobs, e.g. echo with logprobs), or generation."""
    if getattr(params, "pooling", None) is not None:
        return "embedding"
    if getattr(params, "prompt_logprobs", None) is not None:
        return "scoring"
    return "generation"

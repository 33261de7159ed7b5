"""Prometheus metrics of disaggregation, kept by each ingress process that runs it
(cluster/ingress/pd.py), exported through Ray's metrics agent. Names: docs/contracts.md.

- `kvray_pd_decisions_total{decision}`: per request, disaggregated or why it stayed on a
  decode replica (short, resumed, unsupported, no_room);
- `kvray_pd_fallback_total{reason}`: prefill_failed (the decode replica computed the
  prompt), pull_missed (it found the handed-off blocks gone and recomputed them);
- `kvray_pd_handoff_seconds`: from sending a request to a prefill replica to its first
  token, published KV included (the prefill queue, the prefill, the publish).

`ray` is imported inside the constructor, as cluster/routing/metrics.py does.
"""

from __future__ import annotations

from cluster.ray_internals import record_zero

# Decisions (the metric's `decision` label): disaggregated, or why the request stayed local.
DECISIONS = ("disaggregated", "short", "resumed", "unsupported", "no_room")
# Fallbacks (the metric's `reason` label).
FALLBACKS = ("prefill_failed", "pull_missed")

HANDOFF_BUCKETS_S: tuple[float, ...] = (
    0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
)  # fmt: skip


class PdMetrics:
    def __init__(self) -> None:
        from ray.util.metrics import Counter, Histogram

        self._decisions = Counter(
            "kvray_pd_decisions_total",
            "Requests of an application with prefill replicas, by decision: disaggregated, or "
            "the reason it stayed on a decode replica.",
            tag_keys=("decision",),
        )
        self._fallbacks = Counter(
            "kvray_pd_fallback_total",
            "Disaggregated requests whose decode replica computed the prompt after all, by "
            "reason: prefill_failed, pull_missed.",
            tag_keys=("reason",),
        )
        self._handoff = Histogram(
            "kvray_pd_handoff_seconds",
            "Seconds from sending a request to a prefill replica to its first token, the "
            "prompt's KV published.",
            boundaries=list(HANDOFF_BUCKETS_S),
            tag_keys=(),
        )
        for d in DECISIONS:
            record_zero(self._decisions, {"decision": d})
        for r in FALLBACKS:
            record_zero(self._fallbacks, {"reason": r})

    def decided(self, decision: str) -> None:
        self._decisions.inc(tags={"decision": decision})

    def fallback(self, reason: str) -> None:
        self._fallbacks.inc(tags={"reason": reason})

    def handed_off(self, seconds: float) -> None:
        self._handoff.observe(seconds)

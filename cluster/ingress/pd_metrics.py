"""Prometheus metrics of disaggregation, kept by each ingress process that runs it
(cluster/ingress/pd.py), exported through Ray's metrics agent. Names: docs/contracts.md.

- `kvray_pd_decisions_total{decision}`: per request, disaggregated or why it stayed on a
  decode replica (cheaper_local, short, resumed, unsupported, no_room);
- `kvray_pd_fallback_total{reason}`: prefill_failed (the decode replica computed the
  prompt), pull_missed (it found the handed-off blocks gone and recomputed them);
- `kvray_pd_handoff_seconds`: from sending a request to a prefill replica to its first
  token, published KV included (the prefill queue, the prefill, the publish);
- `kvray_pd_ttft_seconds{phase}`: a disaggregated request's time to its first decoded token,
  in phases (`ttft_phases`): prefill_queue and prefill (the prefill engine's own timings),
  handoff (the rest of the prefill call: the hand-off token, publishing the KV, both hops),
  transfer (the decode call until its engine has the request: the pull and the hop) and
  first_decode (the decode engine's queue and resume step).

`ray` is imported inside the constructor, as cluster/routing/metrics.py does.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from cluster.ray_internals import record_zero

if TYPE_CHECKING:
    from workers.outputs import RequestOutput

# Decisions (the metric's `decision` label): disaggregated, or why the request stayed local.
DECISIONS = ("disaggregated", "cheaper_local", "short", "resumed", "unsupported", "no_room")
# Fallbacks (the metric's `reason` label).
FALLBACKS = ("prefill_failed", "pull_missed")
# Phases of a disaggregated request's TTFT (the metric's `phase` label), in order.
PHASES = ("prefill_queue", "prefill", "handoff", "transfer", "first_decode")

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
        self._ttft = Histogram(
            "kvray_pd_ttft_seconds",
            "A disaggregated request's time to its first decoded token, by phase: "
            "prefill_queue, prefill, handoff, transfer, first_decode.",
            boundaries=list(HANDOFF_BUCKETS_S),
            tag_keys=("phase",),
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

    def ttft(self, phases: dict[str, float]) -> None:
        for phase, seconds in phases.items():
            self._ttft.observe(seconds, tags={"phase": phase})


def ttft_phases(
    prefill: RequestOutput, prefill_call_s: float, decode: RequestOutput, decode_first_s: float
) -> dict[str, float] | None:
    """The TTFT phases (PHASES) of one disaggregated request: `prefill` and `decode` are the
    two replicas' final outputs (their engines' timings), `prefill_call_s` the prefill call's
    seconds as the ingress saw them, `decode_first_s` the decode call's until its first
    output. Durations only, so no clock is compared with another process's. None when an
    engine left a timing out (a request it never ran)."""
    p, d = prefill.metrics, decode.metrics
    if p is None or d is None or None in (p.first_scheduled_time, p.first_token_time):
        return None
    if d.first_token_time is None:
        return None
    first_decode = d.first_token_time - d.arrival_time
    return {
        "prefill_queue": p.first_scheduled_time - p.arrival_time,
        "prefill": p.first_token_time - p.first_scheduled_time,
        "handoff": max(0.0, prefill_call_s - (p.first_token_time - p.arrival_time)),
        "transfer": max(0.0, decode_first_s - first_decode),
        "first_decode": first_decode,
    }

"""Prometheus metrics of a replica's side of the cluster KV tier (part of EngineMetrics,
metrics.py; cluster/replica/kv_share.py records them). All zero with the tier off.

Counters: each request's pull decision by outcome (pulled, recompute: the cost model chose
to compute, miss: nothing published past the local cache, failed: the lookup or the pull did
not complete), the prompt tokens pulled instead of computed, blocks published, blocks not
published (the object store or the queue full), and pulled blocks refused by a check. A
histogram of the pulls' seconds (lookup, transfer and checks).
"""

from __future__ import annotations

from typing import Any

from cluster.ray_internals import record_zero
from cluster.replica.kv_share import OUTCOMES

PULL_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0)


class KvShareMetrics:
    """Made by EngineMetrics with its metric constructors (same `model`, `replica` labels)."""

    def __init__(self, tags: dict[str, str], counter: Any, histogram: Any) -> None:
        self._tags = tags
        self._pulls = counter(
            "kvray_kv_share_pulls_total",
            "Pull decisions of requests whose prompt continues past the local KV cache, by "
            "outcome: pulled, recompute (cheaper to compute), miss (not published), failed.",
            ("outcome",),
        )
        self._pulled_tokens = counter(
            "kvray_kv_share_pulled_tokens_total",
            "Prompt tokens whose KV blocks were pulled from a peer instead of computed.",
        )
        self._published = counter(
            "kvray_kv_share_published_blocks_total", "KV blocks published to the object store."
        )
        self._dropped = counter(
            "kvray_kv_share_dropped_blocks_total",
            "KV blocks not published: the object store or the publishing queue was full.",
        )
        self._refused = counter(
            "kvray_kv_share_refused_blocks_total", "Pulled KV blocks refused by a check."
        )
        self._seconds = histogram(
            "kvray_kv_share_pull_seconds",
            "Seconds a pull took: lookup, transfer and checks.",
            PULL_BUCKETS_S,
        )
        for c in (self._pulled_tokens, self._published, self._dropped, self._refused):
            record_zero(c, tags)
        for outcome in OUTCOMES:
            record_zero(self._pulls, {**tags, "outcome": outcome})

    def decided(self, outcome: str) -> None:
        self._pulls.inc(1, tags={"outcome": outcome})

    def pulled(self, tokens: int, seconds: float) -> None:
        self._pulled_tokens.inc(tokens)
        self._seconds.observe(seconds)

    def published(self, n: int) -> None:
        self._published.inc(n)

    def dropped(self, n: int) -> None:
        self._dropped.inc(n)

    def refused(self, n: int) -> None:
        self._refused.inc(n)

"""Per-tenant quotas at the ingress: a token bucket for requests and one for tokens.

A bucket holds up to `burst` (default: one second of its rate) and refills at `rate` per
second. A request is admitted when both of its tenant's buckets hold what it costs (1 request;
prompt tokens + max_tokens × n tokens, `charge`), and takes it from both; else it is refused
with 429 + Retry-After (gRPC RESOURCE_EXHAUSTED), the message naming the quota, the
Retry-After the seconds until the bucket holds enough. A request costing more than a whole
bucket is admitted when the bucket is full and leaves it in debt, so no request is refused
for ever. Unused tokens are given back when the request ends (cluster/ingress/tenant_gate.py):
a request that stops early costs what it used.

Across ingress replicas nothing is shared: each replica enforces `share` (1 / the ingress
replicas) of every rate and burst, so a tenant gets its whole quota when the load balancer
spreads its requests evenly, with no cross-replica hop per request. Under skew (all of one
tenant's requests reaching one replica, e.g. one keep-alive connection) it gets as little as
`share` of its quota. The HTTP and gRPC ingresses keep buckets of their own: a tenant using
both at once can reach up to its quota on each.

The clock is injectable (tests drive it by hand); nothing here sleeps.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from cluster.config.keys_file import Quota
from cluster.errors import QueueFullError
from workers.inputs import EngineInput

# Buckets kept before full ones (equivalent to a fresh bucket) are dropped: the count stays
# bounded by the tenants active within a bucket's refill time, whatever header values arrive.
MAX_BUCKETS = 4096


class QuotaExceededError(QueueFullError):
    """A tenant is over one of its quotas (HTTP 429 + Retry-After, gRPC RESOURCE_EXHAUSTED)."""

    def __init__(self, tenant: str, quota: str, rate: float, retry_after_s: int) -> None:
        super().__init__(
            f"tenant {tenant!r} is over its {quota} quota ({rate:g}); retry in {retry_after_s} s",
            retry_after_s=retry_after_s,
        )
        self.tenant = tenant
        self.quota = quota  # "requests_per_s" | "tokens_per_s"


@dataclass
class TokenBucket:
    rate: float  # refill per second
    burst: float  # capacity
    level: float
    stamp: float  # clock reading of `level`

    @staticmethod
    def full(rate: float, burst: float, now: float) -> TokenBucket:
        return TokenBucket(rate, burst, burst, now)

    def refill(self, now: float) -> None:
        self.level = min(self.burst, self.level + max(0.0, now - self.stamp) * self.rate)
        self.stamp = now

    def wait_s(self, cost: float) -> float:
        """Seconds until `cost` can be taken (0: now); a cost over the burst needs it full."""
        need = min(cost, self.burst)
        return 0.0 if self.level >= need else (need - self.level) / self.rate

    def take(self, cost: float) -> None:
        self.level -= cost  # may go below 0: a cost over the burst leaves a debt

    def give(self, amount: float) -> None:
        self.level = min(self.burst, self.level + amount)

    @property
    def is_full(self) -> bool:
        return self.level >= self.burst


def charge(inp: EngineInput, max_model_len: int) -> int:
    """Tokens one engine input is charged on admission: its prompt, plus max_tokens (None: the
    rest of the context) for each sample; an embedding generates nothing."""
    prompt = len(inp.prompt_token_ids)
    params = inp.params
    if params.pooling is not None:
        return prompt
    new = params.max_tokens if params.max_tokens is not None else max(0, max_model_len - prompt)
    return prompt + new * params.n


class Quotas:
    """One ingress replica's buckets, per tenant (module doc).

    `quotas`: the tenants with a quota of their own (the keys file's); `fallback`: every
    other tenant's, and what a tenant's own quota leaves unset; `share`: this replica's part of
    each rate and burst."""

    def __init__(
        self,
        quotas: Mapping[str, Quota] | None = None,
        fallback: Quota = Quota(),
        share: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._quotas = {t: q.merged(fallback) for t, q in (quotas or {}).items()}
        self._fallback = fallback
        self._share = share
        self._clock = clock
        # tenant -> (requests bucket, tokens bucket); None: that rate is unlimited
        self._buckets: dict[str, tuple[TokenBucket | None, TokenBucket | None]] = {}

    @property
    def limited(self) -> bool:
        """Whether any tenant has a quota (else admit and refund do nothing)."""
        f = self._fallback
        own = any(q.requests_per_s or q.tokens_per_s for q in self._quotas.values())
        return own or f.requests_per_s is not None or f.tokens_per_s is not None

    def quota(self, tenant: str) -> Quota:
        return self._quotas.get(tenant, self._fallback)

    def admit(self, tenant: str, tokens: int) -> None:
        """Takes 1 request and `tokens` from the tenant's buckets, or raises QuotaExceededError
        (taking nothing)."""
        now = self._clock()
        requests, toks = self._of(tenant, now)
        for bucket, cost, name in ((requests, 1, "requests_per_s"), (toks, tokens, "tokens_per_s")):
            if bucket is None:
                continue
            bucket.refill(now)
            wait = bucket.wait_s(cost)
            if wait > 0:
                rate = getattr(self.quota(tenant), name)
                raise QuotaExceededError(tenant, name, rate, max(1, math.ceil(wait)))
        for bucket, cost in ((requests, 1), (toks, tokens)):
            if bucket is not None:
                bucket.take(cost)

    def refund(self, tenant: str, tokens: int) -> None:
        """Gives back tokens a request was charged and did not use."""
        toks = self._buckets.get(tenant, (None, None))[1]
        if toks is not None and tokens > 0:
            toks.refill(self._clock())
            toks.give(tokens)

    def _of(self, tenant: str, now: float) -> tuple[TokenBucket | None, TokenBucket | None]:
        pair = self._buckets.get(tenant)
        if pair is None:
            if len(self._buckets) >= MAX_BUCKETS:
                self._drop_full(now)
            q = self.quota(tenant)
            pair = (
                self._bucket(q.requests_per_s, q.requests_burst, now),
                self._bucket(q.tokens_per_s, q.tokens_burst, now),
            )
            self._buckets[tenant] = pair
        return pair

    def _bucket(self, rate: float | None, burst: float | None, now: float) -> TokenBucket | None:
        if rate is None:
            return None
        return TokenBucket.full(rate * self._share, (burst or rate) * self._share, now)

    def _drop_full(self, now: float) -> None:
        for tenant, pair in list(self._buckets.items()):
            for b in pair:
                if b is not None:
                    b.refill(now)
            if all(b is None or b.is_full for b in pair):
                del self._buckets[tenant]

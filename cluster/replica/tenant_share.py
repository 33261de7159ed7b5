"""A fair share of one replica's waiting queue for each tenant (`EngineInput.tenant`).

A replica refuses (429) a request when its waiting queue is at `max_queued_requests` samples,
or its waiting prompt tokens at `max_queued_tokens` (cluster/replica/queued_tokens.py). With
tenants, a full queue still takes a request whose tenant's part of the queue, with this
request, stays within its share of that cap: the cap divided by the number of tenants with
requests waiting here (its own included). So the requests refused are those of the tenants at
or over their share, and one tenant's burst
cannot lock the others out; the engine then takes the tenants in turn (its scheduler), so the
burst does not hold their requests back either. The queue passes the cap by at most the
under-share tenants' shares, less than the cap again. One tenant alone has the whole cap:
without tenants nothing changes.

What each tenant holds is estimated: the replica sees a request start when its first output
comes, which a streamed request sends after its first token and one that is not streamed only
at its end. So each tenant's not-yet-started samples (and prompt tokens) are scaled down to
the queue the replica counts (`queued`: in flight minus the engine's running count; the
engine's waiting prefill tokens), i.e. the waiting queue is divided among tenants in
proportion to what they have in flight here that has not been seen to start.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from cluster.replica.queued_tokens import QueuedTokens, prompt_cost

if TYPE_CHECKING:
    from workers.core.stats import EngineStats
    from workers.inputs import EngineInput


@dataclass
class _Held:
    tenant: str | None
    samples: int
    tokens: int


class TenantShare:
    """The requests in flight on one replica that have not been seen to start, by tenant."""

    def __init__(self) -> None:
        self._unstarted: dict[str, _Held] = {}  # request id -> what it holds

    def admits(self, inp: EngineInput, queued: int, cap: int) -> bool:
        """Whether a request may join a queue of `queued` samples capped at `cap`: below the
        cap, or its tenant's samples there, with its own, within the tenant's share."""
        samples = len(inp.resume) or inp.params.n
        return queued < cap or self.under_share(inp.tenant, "samples", queued, cap, samples)

    def enter(
        self,
        queued_tokens: QueuedTokens,
        request_id: str,
        inp: EngineInput,
        samples: int,
        stats: EngineStats,
    ) -> None:
        """Admits the request by its prompt tokens (the tenant's share counts past the cap;
        else QueueFullError) and holds it as waiting until its first output."""
        cost = prompt_cost(inp)
        queued_tokens.admit(
            request_id,
            cost,
            stats,
            lambda waiting, limit: self.under_share(inp.tenant, "tokens", waiting, limit, cost),
        )
        self._unstarted[request_id] = _Held(inp.tenant, samples, cost)

    def started(self, request_id: str) -> None:
        """Its first output came: it runs (cheap; called for every output)."""
        if self._unstarted:
            self._unstarted.pop(request_id, None)

    def left(self, request_id: str) -> None:
        self._unstarted.pop(request_id, None)

    def under_share(
        self, tenant: str | None, kind: str, waiting: float, cap: float, cost: float
    ) -> bool:
        """Whether what `tenant` holds of the queue, plus `cost`, stays within its share of
        `cap` (module doc); `waiting`: the replica's own count of what waits, `kind`:
        "samples" or "tokens"."""
        held: dict[str | None, float] = {}
        for h in self._unstarted.values():
            amount = h.samples if kind == "samples" else h.tokens
            held[h.tenant] = held.get(h.tenant, 0.0) + amount
        total = sum(held.values())
        if total <= 0:
            return False  # nothing known to wait here: the cap as it is
        scale = min(1.0, waiting / total)
        holders = {t for t, v in held.items() if v * scale > 0} | {tenant}
        return held.get(tenant, 0.0) * scale + cost <= cap / len(holders)

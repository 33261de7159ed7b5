"""The tenant's way through an ingress, the same for HTTP and gRPC: quota on admission,
refunds and metrics when each engine request ends.

    prepared = await preparer.prepare(body, tenant=current_tenant())  # inputs carry the tenant
    await gate.admit(prepared)                       # 429 over quota
    outs = gate.metered(client.generate(r), r)       # per engine request

The engine inputs carry the tenant from their check (cluster/ingress/prepare.py): by it each
engine takes tenants in turn and each replica shares its queue fairly
(cluster/replica/tenant_share.py). `admit` charges that tenant (the current one,
cluster/ingress/tenants.py, for inputs that name none): one request and `charge` tokens per
input (cluster/ingress/quotas.py). `metered` passes the outputs through; when the request
ends it gives back the tokens it was charged and did not use (a final output: prompt + the
tokens generated; a failure before any output, e.g. a full replica queue: all of them; a
failure later: what the outputs so far did not use). A request its client abandons keeps its
whole charge, so cancelling cannot dodge a quota. It counts tokens, queue time and
queue_full refusals by tenant (cluster/ingress/tenant_metrics.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from cluster.config.keys_file import Quota, load_keys_file
from cluster.errors import QueueFullError
from cluster.ingress.prepare import InputCheckers, Prepared
from cluster.ingress.quotas import QuotaExceededError, Quotas, charge
from cluster.ingress.tenants import current_tenant

if TYPE_CHECKING:
    from cluster.config import ServeConfig
    from cluster.ingress.tenant_metrics import TenantMetrics
    from cluster.messages import GenerateRequest
    from workers.outputs import RequestOutput

QUOTA_REASONS = {"requests_per_s": "quota_requests", "tokens_per_s": "quota_tokens"}


class TenantGate:
    """One ingress replica's quotas and tenant metrics (module doc)."""

    def __init__(
        self,
        checkers: InputCheckers | None = None,
        quotas: Quotas | None = None,
        metrics: TenantMetrics | None = None,
    ) -> None:
        self._checkers = checkers  # the served model's limits (LLMClient): see `serving`
        self.quotas = quotas or Quotas()
        self.metrics = metrics
        self._max_model_len = 0  # the served model's, once a request was admitted

    def serving(self, checkers: InputCheckers) -> TenantGate:
        """This gate, reading the served model's limits from `checkers` (an LLMClient)."""
        self._checkers = checkers
        return self

    @staticmethod
    def from_config(
        config: ServeConfig, checkers: InputCheckers | None = None, metrics: bool = True
    ) -> TenantGate:
        """From a ServeConfig, for an ingress deployment of `config.replicas.ingress_replicas`
        replicas (each enforces its share of every quota; the keys file is read here)."""
        path = config.tenants.api_keys_file
        keys = load_keys_file(path) if path else None
        fallback = Quota(config.tenants.tenant_requests_per_s, config.tenants.tenant_tokens_per_s)
        quotas = Quotas(
            keys.quotas if keys else None, fallback, share=1.0 / config.replicas.ingress_replicas
        )
        tenant_metrics = None
        if metrics:
            from cluster.ingress.tenant_metrics import TenantMetrics

            tenant_metrics = TenantMetrics(keys.tenants if keys else ())
        return TenantGate(checkers, quotas, tenant_metrics)

    async def admit(self, prepared: Prepared) -> None:
        """Charges the tenant of `prepared` for it (QuotaExceededError: 429, nothing taken)."""
        tenant = prepared.inputs[0].tenant or current_tenant()
        if self.quotas.limited and self._checkers is not None:  # the client caches it
            self._max_model_len = (await self._checkers.input_checker()).max_model_len
        tokens = sum(charge(inp, self._max_model_len) for inp in prepared.inputs)
        try:
            self.quotas.admit(tenant, tokens)
        except QuotaExceededError as err:
            if self.metrics is not None:
                self.metrics.rejected(tenant, QUOTA_REASONS[err.quota])
            raise
        if self.metrics is not None:
            self.metrics.admitted(tenant)

    async def metered(
        self, outputs: AsyncIterator[RequestOutput], request: GenerateRequest
    ) -> AsyncIterator[RequestOutput]:
        """`outputs` of one engine request, refunding and counting when it ends."""
        inp = request.input
        tenant = inp.tenant or current_tenant()
        charged = charge(inp, self._max_model_len)
        prompt = len(inp.prompt_token_ids)
        generated = 0  # tokens of the outputs so far (deltas; the final one: all)
        seen = False
        async with contextlib.aclosing(outputs):
            try:
                async for out in outputs:
                    seen = True
                    if out.finished:
                        generated = sum(len(o.token_ids) for o in out.outputs)
                        self._ended(tenant, charged, prompt + generated, out)
                        charged = 0  # settled
                    else:
                        generated += sum(len(o.delta_token_ids or ()) for o in out.outputs)
                    yield out
            except Exception as exc:  # the client's errors are cluster.errors classes
                if not seen and isinstance(exc, QueueFullError) and self.metrics is not None:
                    self.metrics.rejected(tenant, "queue_full")
                if charged:
                    self._ended(tenant, charged, prompt + generated if seen else 0, None)
                raise

    def _ended(self, tenant: str, charged: int, used: int, final: RequestOutput | None) -> None:
        self.quotas.refund(tenant, charged - used)
        if self.metrics is None:
            return
        self.metrics.tokens(tenant, used)
        m = final.metrics if final is not None else None
        if m is not None and m.first_scheduled_time is not None:
            self.metrics.queue_time(tenant, m.first_scheduled_time - m.arrival_time)

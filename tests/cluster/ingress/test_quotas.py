"""Token buckets per tenant, on a clock the test moves by hand (nothing sleeps)."""

from __future__ import annotations

import pytest

from cluster.config.keys_file import Quota
from cluster.ingress.quotas import MAX_BUCKETS, QuotaExceededError, Quotas, TokenBucket, charge
from workers.inputs import EngineInput
from workers.pooling import Pooling
from workers.sampling_params import SamplingParams


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _refused(quotas: Quotas, tenant: str, tokens: int) -> QuotaExceededError:
    with pytest.raises(QuotaExceededError) as err:
        quotas.admit(tenant, tokens)
    return err.value


def test_bucket_refills_at_its_rate_up_to_its_burst() -> None:
    b = TokenBucket.full(rate=2.0, burst=4.0, now=0.0)
    assert b.wait_s(4) == 0
    b.take(4)
    assert b.wait_s(1) == pytest.approx(0.5)
    b.refill(1.0)
    assert b.level == pytest.approx(2.0)
    b.refill(60.0)
    assert b.level == 4.0 and b.is_full


def test_a_cost_over_the_burst_waits_for_a_full_bucket_and_leaves_a_debt() -> None:
    b = TokenBucket.full(rate=10.0, burst=100.0, now=0.0)
    b.take(50)
    assert b.wait_s(500) == pytest.approx(5.0)  # until full, not until 500 are there
    b.refill(5.0)
    assert b.wait_s(500) == 0
    b.take(500)
    assert b.level == -400
    assert b.wait_s(1) == pytest.approx(40.1)


def test_requests_quota_refuses_with_retry_after_and_names_it() -> None:
    clock = Clock()
    quotas = Quotas({"acme": Quota(requests_per_s=0.5, requests_burst=2)}, clock=clock)
    quotas.admit("acme", 10)
    quotas.admit("acme", 10)
    err = _refused(quotas, "acme", 10)
    assert err.message.startswith("tenant 'acme' is over its requests_per_s quota (0.5)")
    assert (err.http_status, err.grpc_code, err.openai_type) == (
        429,
        "RESOURCE_EXHAUSTED",
        "rate_limit_exceeded",
    )
    assert err.http_headers() == {"Retry-After": "2"}  # 1 request at 0.5/s
    assert err.quota == "requests_per_s" and err.tenant == "acme"
    quotas.admit("beta", 10**6)  # another tenant: no quota of its own, no fallback
    clock.now += 2.0
    quotas.admit("acme", 10)


def test_tokens_quota_takes_nothing_when_it_refuses() -> None:
    clock = Clock()
    quotas = Quotas({"acme": Quota(requests_per_s=2, tokens_per_s=100)}, clock=clock)
    quotas.admit("acme", 60)
    err = _refused(quotas, "acme", 60)
    assert "over its tokens_per_s quota (100)" in err.message
    assert err.retry_after_s == 1  # 20 tokens missing at 100/s: rounded up
    clock.now += 0.2  # 20 tokens back; the refused request took no request from its bucket
    quotas.admit("acme", 60)
    assert "requests_per_s quota (2)" in _refused(quotas, "acme", 0).message


def test_refunds_give_back_unused_tokens_up_to_the_burst() -> None:
    clock = Clock()
    quotas = Quotas({"t": Quota(tokens_per_s=1, tokens_burst=100)}, clock=clock)
    quotas.admit("t", 90)
    _refused(quotas, "t", 90)
    quotas.refund("t", 80)  # the request used 10 of its 90
    quotas.admit("t", 90)
    quotas.refund("t", 10**6)
    quotas.refund("nobody", 5)  # no bucket: nothing to give back
    quotas.admit("t", 100)  # capped at the burst, not above
    _refused(quotas, "t", 1)


def test_fallback_quota_for_every_tenant_without_its_own() -> None:
    clock = Clock()
    quotas = Quotas(
        {"big": Quota(requests_per_s=100)}, Quota(requests_per_s=1, tokens_per_s=50), clock=clock
    )
    assert quotas.limited
    quotas.admit("header-tenant", 50)
    assert "requests_per_s quota (1)" in _refused(quotas, "header-tenant", 1).message
    quotas.admit("default", 1)  # each tenant its own buckets
    for _ in range(50):  # big's own request rate; its token rate is the fallback's
        quotas.admit("big", 1)
    assert "tokens_per_s quota (50)" in _refused(quotas, "big", 1).message


def test_each_ingress_replica_enforces_its_share() -> None:
    clock = Clock()
    quotas = Quotas({"acme": Quota(requests_per_s=4)}, share=0.5, clock=clock)
    quotas.admit("acme", 1)
    quotas.admit("acme", 1)
    err = _refused(quotas, "acme", 1)
    assert "(4)" in err.message  # the tenant's quota, not this replica's share of it
    clock.now += 0.5  # 2 per second here
    quotas.admit("acme", 1)


def test_no_quota_anywhere_is_unlimited() -> None:
    quotas = Quotas()
    assert not quotas.limited
    for _ in range(1000):
        quotas.admit("any", 10**9)


def test_full_buckets_are_dropped_when_too_many() -> None:
    clock = Clock()
    quotas = Quotas(fallback=Quota(requests_per_s=1), clock=clock)
    for i in range(MAX_BUCKETS):
        quotas.admit(f"t{i}", 1)
    clock.now += 5  # every bucket full again: as good as new
    quotas.admit("fresh", 1)
    assert len(quotas._buckets) == 1


def test_charge_is_prompt_plus_max_tokens_times_n() -> None:
    prompt = tuple(range(10))
    inp = EngineInput(prompt, SamplingParams(max_tokens=20, n=3))
    assert charge(inp, 4096) == 10 + 20 * 3
    rest = EngineInput(prompt, SamplingParams(max_tokens=None))
    assert charge(rest, 100) == 100  # the rest of the context
    embed = EngineInput(prompt, SamplingParams(max_tokens=1, pooling=Pooling()))
    assert charge(embed, 4096) == 10

"""A tenant's fair share of a full replica queue: within its share it may still enqueue, over it
it is the one refused; one tenant alone keeps the plain cap."""

from __future__ import annotations

import pytest

from cluster.errors import QueueFullError
from cluster.replica.queued_tokens import QueuedTokens
from cluster.replica.tenant_share import TenantShare
from workers.core.stats import EngineStats
from workers.inputs import EngineInput
from workers.sampling_params import SamplingParams

CAP = 4


def _inp(tenant: str | None, prompt_len: int = 10, n: int = 1) -> EngineInput:
    return EngineInput(tuple(range(prompt_len)), SamplingParams(n=n), tenant=tenant)


def _fill(share: TenantShare, tenant: str | None, count: int, prefix: str = "r") -> None:
    tokens = QueuedTokens(10**9)
    for i in range(count):
        share.enter(tokens, f"{prefix}{tenant}{i}", _inp(tenant), 1, EngineStats())


def test_one_tenants_burst_fills_the_queue_and_another_still_gets_in() -> None:
    share = TenantShare()
    _fill(share, "burst", CAP)
    # The queue is full (CAP waiting): the burst tenant is over its share...
    assert not share.admits(_inp("burst"), CAP, CAP)
    # ...the other holds nothing: with this request it stays within its share (CAP / 2).
    assert share.admits(_inp("calm"), CAP, CAP)
    _fill(share, "calm", 1)
    assert share.admits(_inp("calm"), CAP + 1, CAP)  # 1 + 1 of a share of 2
    assert not share.admits(_inp("calm", n=2), CAP + 1, CAP)  # 1 + 2: past it
    _fill(share, "calm", 1, prefix="s")
    assert not share.admits(_inp("calm"), CAP + 2, CAP)  # at its share: no more
    assert not share.admits(_inp("burst"), CAP + 2, CAP)


def test_below_the_cap_everyone_is_admitted_and_alone_the_cap_holds() -> None:
    share = TenantShare()
    _fill(share, None, CAP - 1)
    assert share.admits(_inp(None), CAP - 1, CAP)
    _fill(share, None, 1, prefix="x")
    assert not share.admits(_inp(None), CAP, CAP)  # without tenants: as before
    assert TenantShare().admits(_inp("a"), 0, CAP)
    assert not TenantShare().under_share("a", "samples", CAP, CAP, 1)  # nothing known waits


def test_started_requests_no_longer_count_and_the_estimate_scales_to_the_queue() -> None:
    share = TenantShare()
    _fill(share, "a", 4)
    _fill(share, "b", 4)
    # The replica counts 4 waiting although 8 have not been seen to start (some run unseen,
    # not streamed): each tenant's part is scaled down to 2, at its share of 4 / 2.
    assert not share.under_share("a", "samples", 4, CAP, 1)
    share.started("ra0")
    share.started("ra1")
    share.left("ra2")
    # a holds 1 of 5 unstarted, scaled to 0.8: with one more, within its share of 2...
    assert share.under_share("a", "samples", 4, CAP, 1)
    # ...and b, 3.2, not.
    assert not share.under_share("b", "samples", 4, CAP, 1)
    share.left("ra3")
    # b, the only tenant waiting now, has the whole cap: 4 and one more is past it.
    assert not share.under_share("b", "samples", 4, CAP, 1)
    assert share.under_share("b", "samples", 4, CAP + 1, 1)


def test_the_token_cap_is_shared_the_same_way() -> None:
    share = TenantShare()
    tokens = QueuedTokens(limit=100)
    stats = EngineStats()
    share.enter(tokens, "b1", _inp("burst", 60), 1, stats)
    share.enter(tokens, "b2", _inp("burst", 40), 1, stats)
    # 100 tokens wait, all the burst's; another 40 of it would pass the cap: refused.
    with pytest.raises(QueueFullError, match=r"max_queued_tokens=100"):
        share.enter(tokens, "b3", _inp("burst", 40), 1, stats)
    # The calm tenant holds none of them: 40 stay within its share (100 / 2), past the cap.
    share.enter(tokens, "c1", _inp("calm", 40), 1, stats)
    assert tokens.waiting(stats) == 140
    share.enter(tokens, "c2", _inp("calm", 10), 1, stats)  # 50: at its share
    with pytest.raises(QueueFullError):
        share.enter(tokens, "c3", _inp("calm", 1), 1, stats)
    with pytest.raises(QueueFullError):
        share.enter(tokens, "b4", _inp("burst", 1), 1, stats)

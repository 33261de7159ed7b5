"""The tenants workload: one system prompt per tenant, Zipf popularity, seeded."""

from __future__ import annotations

from collections import Counter

import pytest

from cluster.bench.serve.tenants import zipf_tenant_workload


def _workload(zipf_s: float, seed: int = 1, num_prompts: int = 400):
    return zipf_tenant_workload(
        range(100, 200), num_prompts=num_prompts, num_tenants=8, prefix_len=32, input_len=48,
        output_len=5, zipf_s=zipf_s, seed=seed,
    )  # fmt: skip


def _tenant_counts(w) -> list[int]:  # noqa: ANN001
    return sorted(Counter(r.prompt_ids[:32] for r in w.requests).values(), reverse=True)


def test_requests_share_their_tenants_prefix_and_are_seeded() -> None:
    w = _workload(1.0)
    assert len(w.requests) == 400 and all(r.prompt_len == 48 for r in w.requests)
    assert {r.output_len for r in w.requests} == {5}
    # Suffixes are the request's own.
    assert len({r.prompt_ids[32:] for r in w.requests}) == 400
    assert _workload(1.0) == w and _workload(1.0, seed=2) != w
    assert w.params["distinct_tenants_drawn"] == len(_tenant_counts(w)) <= 8


def test_zipf_skews_popularity_and_zero_is_uniform() -> None:
    skewed, uniform = _tenant_counts(_workload(1.5)), _tenant_counts(_workload(0.0))
    # s = 1.5 over 8 tenants: the hottest draws ~48 % of requests; uniform: 12.5 % each.
    assert skewed[0] > 0.35 * 400 and len(uniform) == 8 and uniform[0] < 0.2 * 400


@pytest.mark.parametrize(
    "bad", [{"num_tenants": 0}, {"prefix_len": 48}, {"prefix_len": 0}, {"output_len": 0},
            {"zipf_s": -1.0}],
)  # fmt: skip
def test_bad_shapes_are_refused(bad: dict) -> None:
    kw = dict(num_prompts=1, num_tenants=2, prefix_len=8, input_len=16, output_len=1,
              zipf_s=1.0, seed=0) | bad  # fmt: skip
    with pytest.raises(ValueError):
        zipf_tenant_workload(range(10), **kw)

"""`kvray bench serve` workloads: tenants sharing prefixes, seeded."""

from __future__ import annotations

import pytest

from cluster.bench.serve_workload import tenant_workload


def test_tenant_workload_shares_prefixes_per_tenant() -> None:
    w = tenant_workload(
        range(100, 200), num_prompts=40, num_tenants=3, prefix_len=32, input_len=48,
        output_len=5, seed=1,
    )  # fmt: skip
    assert len(w.requests) == 40 and all(r.prompt_len == 48 for r in w.requests)
    prefixes = {r.prompt_ids[:32] for r in w.requests}
    assert len(prefixes) == 3
    again = tenant_workload(
        range(100, 200), num_prompts=40, num_tenants=3, prefix_len=32, input_len=48,
        output_len=5, seed=1,
    )  # fmt: skip
    assert again == w
    with pytest.raises(ValueError):
        tenant_workload(
            [1], num_prompts=1, num_tenants=1, prefix_len=8, input_len=8, output_len=1, seed=0
        )

"""`kvray bench serve` workloads from its arguments: random, shared-prefix, tenants-zipf."""

from __future__ import annotations

import argparse
from collections import Counter

from cluster.bench.serve.workload import build_workload


def _args(workload: str) -> argparse.Namespace:
    return argparse.Namespace(
        workload=workload, num_prompts=300, num_tenants=4, prefix_len=32, input_len=48,
        output_len=5, zipf_s=2.0, seed=1,
    )  # fmt: skip


def test_random_prompts_have_the_asked_lengths() -> None:
    w = build_workload(_args("random"), range(100, 200))
    assert w.name == "random" and len(w.requests) == 300
    assert {(r.prompt_len, r.output_len) for r in w.requests} == {(48, 5)}


def test_shared_prefix_is_tenants_with_uniform_popularity() -> None:
    shared = build_workload(_args("shared-prefix"), range(100, 200))
    zipf = build_workload(_args("tenants-zipf"), range(100, 200))
    assert (shared.name, zipf.name) == ("shared-prefix", "tenants-zipf")
    assert shared.params["zipf_s"] == 0.0 and zipf.params["zipf_s"] == 2.0
    counts = [Counter(r.prompt_ids[:32] for r in w.requests) for w in (shared, zipf)]
    assert len(counts[0]) == 4 and max(counts[0].values()) < 0.4 * 300
    assert max(counts[1].values()) > 0.5 * 300  # s = 2 over 4 tenants: ~70 % on the first

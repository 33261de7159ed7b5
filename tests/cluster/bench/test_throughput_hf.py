"""The transformers peers of `kvray bench throughput`: static batches (the hf rule)."""

from __future__ import annotations

from cluster.bench.common import BenchRequest, Workload
from cluster.bench.throughput_hf import hf_batches


def test_hf_batches_fill_in_order_up_to_size_and_context() -> None:
    shape = [(4, 20), (4, 20), (4, 20), (20, 4), (4, 4)]
    reqs = tuple(BenchRequest((1,) * n, o) for n, o in shape)
    work = Workload("t", reqs)
    assert [len(b) for b in hf_batches(work, 2, 1000)] == [2, 2, 1]
    # With the 20-token prompt the batch would need 20 + 20 > 32 positions: cut before it.
    batches = hf_batches(work, 8, 32)
    assert [len(b) for b in batches] == [3, 2]
    assert [r for b in batches for r in b] == list(reqs)  # order kept

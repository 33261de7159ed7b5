"""The transformers peers of `kvray bench throughput`: static batches (the hf rule)."""

from __future__ import annotations

import dataclasses

from cluster.bench.common.workload import BenchRequest, Workload
from cluster.bench.throughput.hf import hf_batches


def test_hf_batches_fill_in_order_up_to_size_and_context() -> None:
    shape = [(4, 20), (4, 20), (4, 20), (20, 4), (4, 4)]
    reqs = tuple(BenchRequest((1,) * n, o) for n, o in shape)
    work = Workload("t", reqs)
    assert [len(b) for b in hf_batches(work, 2, 1000)] == [2, 2, 1]
    # With the 20-token prompt the batch would need 20 + 20 > 32 positions: cut before it.
    batches = hf_batches(work, 8, 32)
    assert [len(b) for b in batches] == [3, 2]
    assert [r for b in batches for r in b] == list(reqs)  # order kept


def test_cb_config_speaks_both_spellings_of_transformers() -> None:
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    from cluster.bench.throughput.hf import _cb_config

    # The installed transformers: page_size is passed through as it is.
    config = _cb_config(ContinuousBatchingConfig, page_size=64, num_blocks=7)
    assert config.num_blocks == 7
    assert getattr(config, "page_size", getattr(config, "block_size", None)) == 64

    # Up to 5.17 the field was block_size, and newer options did not exist yet.
    @dataclasses.dataclass
    class Before518:
        block_size: int = 256
        num_blocks: int | None = None

    old = _cb_config(Before518, page_size=64, num_blocks=7, auto_switch_to_flash=True)
    assert old == Before518(block_size=64, num_blocks=7)
